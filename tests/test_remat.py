"""Remat: equal gradients, really rematerialised, class-name form, clear errors."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from conftest import make_classification, tree_allclose
from flax import nnx

import trainkit as tk


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(32)(nn.LayerNorm()(x))
        return x + nn.Dense(x.shape[-1])(nn.gelu(h))


class Tower(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(16)(x)
        for _ in range(3):
            x = Block()(x, train)
        return nn.Dense(3)(x)


def _grads_and_jaxpr(remat, x, y):
    trainer = tk.Trainer(
        Tower(),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.sgd(0.1),
        strategy="single",
        remat=remat,
        seed=0,
    )
    state = trainer.init(x)
    batch = {"x": x, "y": y, "mask": np.ones(len(x), np.float32)}

    def loss(params):
        values, _ = trainer.compute_loss(params, batch, state.rng, model_state=state.model_state, train=True)
        return values.mean()

    return jax.grad(loss)(state.params), str(jax.make_jaxpr(jax.grad(loss))(state.params))


@pytest.mark.parametrize(
    "remat",
    ["full", "dots", "dots_no_batch", jax.checkpoint_policies.nothing_saveable, ["Block"]],
    ids=["full", "dots", "dots_no_batch", "policy", "class_names"],
)
def test_gradients_equal_without_remat_and_remat_is_applied(remat):
    x, y = make_classification(16)
    reference, plain = _grads_and_jaxpr(None, x, y)
    grads, jaxpr = _grads_and_jaxpr(remat, x, y)
    tree_allclose(grads, reference, rtol=1e-5, atol=1e-6)
    assert "remat" not in plain and "checkpoint" not in plain
    expected = 3 if isinstance(remat, list) else 5  # three Blocks, or all five direct submodules
    assert jaxpr.count("remat") + jaxpr.count("checkpoint[") >= expected


def test_training_with_block_remat_matches_no_remat_on_8_devices():
    x, y = make_classification(100)
    params = []
    for remat in (None, ["Block"]):
        trainer = tk.Trainer(
            Tower(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(0.01), strategy="dp", remat=remat
        )
        trainer.fit((x, y), batch_size=16, epochs=1, verbose=0)
        params.append(trainer.params)
    tree_allclose(params[0], params[1], rtol=1e-5, atol=1e-6)


def test_remat_errors():
    with pytest.raises(ValueError, match=r"Unknown remat policy 'everything'. Known names: full, dots"):
        tk.Trainer(Tower(), loss="mse", optimizer=optax.sgd(0.1), remat="everything", strategy="dp")
    with pytest.raises(TypeError, match="remat must be"):
        tk.Trainer(Tower(), loss="mse", optimizer=optax.sgd(0.1), remat=3, strategy="dp")

    class Linear(nnx.Module):
        def __init__(self):
            self.layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.layer(x)

    with pytest.raises(ValueError, match="needs a flax.linen module.*nnx.remat"):
        tk.Trainer(Linear(), loss="mse", optimizer=optax.sgd(0.1), remat="full", strategy="dp")


class DropoutBlock(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return x + nn.Dropout(0.5, deterministic=not train)(nn.Dense(x.shape[-1])(x))


class DropoutTower(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(16)(x)
        x = DropoutBlock()(x, train)
        x = nn.BatchNorm(use_running_average=not train)(x)  # mutable state: lifted checkpoint
        return nn.Dense(3)(x)


def test_remat_with_dropout_and_batch_norm_trains_and_masks_vary():
    x, y = make_classification(64)
    trainer = tk.Trainer(
        DropoutTower(),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.adam(0.02),
        strategy="single",
        remat="full",
    )
    history = trainer.fit((x, y), batch_size=16, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    state = trainer.state
    batch = {"x": x[:16], "y": y[:16], "mask": np.ones(16, np.float32)}
    losses = [
        float(
            trainer.compute_loss(state.params, batch, jax.random.PRNGKey(k), model_state=state.model_state, train=True)[
                0
            ].mean()
        )
        for k in (0, 1)
    ]
    assert losses[0] != losses[1]  # dropout is active under remat, with the step's key
