"""Model kinds: dropout and BatchNorm (linen), NNX, several inputs, custom losses, fine-tuning."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, NoisyMLP, make_classification, tree_allclose
from flax import nnx

import trainkit as tk
from trainkit.core.state import TrainState
from trainkit.core.step import _step_rng


def test_dropout_keys_differ_per_step_and_per_device():
    state = TrainState.create(params={}, opt_state=(), model_state={}, seed=0)
    k0, k1 = _step_rng(state, None), _step_rng(state.replace(step=state.step + 1), None)
    assert not np.array_equal(k0, k1)
    per_device = jax.pmap(
        lambda s, _: _step_rng(s, "data"), axis_name="data", in_axes=(None, 0), devices=jax.devices()
    )(state, np.zeros(8))
    assert len({tuple(np.asarray(k)) for k in per_device}) == 8


def test_batch_norm_statistics_are_averaged_across_devices():
    x, y = make_classification(16)
    stats = {}
    for name, strategy in (("single", tk.SingleDevice()), ("dp", tk.DataParallel())):
        trainer = tk.Trainer(
            NoisyMLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy=strategy, seed=1
        )
        trainer.init(x)
        before = jax.device_get(trainer.state.model_state)
        trainer.fit((x, y), batch_size=16, epochs=1, verbose=0)
        stats[name] = jax.device_get(trainer.state.model_state)["batch_stats"]
        assert not np.allclose(stats[name]["BatchNorm_0"]["mean"], before["batch_stats"]["BatchNorm_0"]["mean"])
    # With equal shards, the mean of the 8 per-device means is the global mean.
    np.testing.assert_allclose(
        stats["dp"]["BatchNorm_0"]["mean"], stats["single"]["BatchNorm_0"]["mean"], rtol=1e-5, atol=1e-6
    )


def test_dropout_and_batch_norm_train_and_switch_to_inference():
    x, y = make_classification(256)
    trainer = tk.Trainer(
        NoisyMLP(),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.adam(0.02),
        metrics=["accuracy"],
        strategy="dp",
    )
    history = trainer.fit((x, y), epochs=15, batch_size=32, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    # Inference is deterministic: dropout off, running statistics used.
    np.testing.assert_array_equal(trainer.predict(x[:20]), trainer.predict(x[:20]))
    assert trainer.evaluate((x, y), return_dict=True)["accuracy"] > 0.8


class NNXClassifier(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, noisy: bool = True):
        self.hidden = nnx.Linear(5, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs) if noisy else None
        self.dropout = nnx.Dropout(0.2, rngs=rngs) if noisy else None
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        x = self.hidden(x)
        if self.norm is not None:
            x = self.dropout(nnx.relu(self.norm(x)))
        return self.out(nnx.relu(x))


@pytest.mark.parametrize("strategy", ["single", "data_parallel"])
def test_nnx_module_trains_with_the_same_calls(strategy):
    x, y = make_classification(256)
    trainer = tk.Trainer(
        NNXClassifier(nnx.Rngs(0, dropout=1)),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.adam(0.02),
        metrics=["accuracy"],
        strategy=strategy,
    )
    history = trainer.fit((x, y), epochs=10, batch_size=32, validation_data=(x[:64], y[:64]), verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert "batch_stats" not in trainer.state.model_state  # NNX keeps its own names
    assert set(trainer.state.model_state["norm"]) == {"mean", "var"}
    assert trainer.evaluate((x, y), return_dict=True)["accuracy"] > 0.8
    assert trainer.predict(x[:7]).shape == (7, 3)


def test_nnx_strategies_agree_without_randomness():
    x, y = make_classification(100)
    params = []
    for strategy in ("single", "data_parallel"):
        trainer = tk.Trainer(
            NNXClassifier(nnx.Rngs(0), noisy=False),
            loss="sparse_categorical_crossentropy",
            optimizer=optax.sgd(0.1),
            strategy=strategy,
        )
        trainer.fit((x, y), epochs=2, batch_size=16, shuffle=False, verbose=0)
        params.append(trainer.params)
    tree_allclose(params[0], params[1])


class TwoInputs(nn.Module):
    @nn.compact
    def __call__(self, image, extra, training: bool = False):
        return nn.Dense(3)(jnp.concatenate([image.reshape(image.shape[0], -1), extra], -1))


def test_dict_of_inputs_is_passed_by_name():
    rng = np.random.default_rng(0)
    x = {"image": rng.normal(size=(40, 2, 2)).astype(np.float32), "extra": rng.normal(size=(40, 3)).astype(np.float32)}
    y = (x["extra"][:, 0] > 0).astype(np.int32)
    trainer = tk.Trainer(TwoInputs(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(0.1), strategy="dp")
    trainer.fit(x, y, epochs=3, batch_size=8, verbose=0)
    assert trainer.predict(x).shape == (40, 3)
    with pytest.raises(ValueError, match=r"lack \[\"x\['extra'\]\"\].*initialised with"):
        trainer.predict({"image": x["image"]})


class AutoEncoderTrainer(tk.Trainer):
    """A loss that is not loss(predictions, y): reconstruct the inputs."""

    def compute_loss(self, params, batch, rng, *, model_state, train):
        reconstruction, model_state = self.apply(params, model_state, batch["x"], rng=rng, train=train)
        return jnp.mean((reconstruction - batch["x"]) ** 2, axis=-1), (reconstruction, model_state)


def test_compute_loss_override_trains_without_targets():
    x, _ = make_classification(64)
    trainer = AutoEncoderTrainer(MLP(classes=5), optimizer=optax.adam(0.02), strategy="dp")
    history = trainer.fit(x, epochs=5, batch_size=16, verbose=0)
    assert history.history["loss"][-1] < 0.7 * history.history["loss"][0]
    assert trainer.evaluate(x, batch_size=16, return_dict=True)["loss"] == pytest.approx(
        float(np.mean((trainer.predict(x) - x) ** 2)), rel=1e-5
    )


def test_fine_tuning_starts_from_given_variables():
    x, y = make_classification(64)
    first = tk.Trainer(NoisyMLP(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(0.01), strategy="dp")
    first.fit((x, y), epochs=2, batch_size=16, verbose=0)
    second = tk.Trainer(
        NoisyMLP(),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.sgd(0.01),
        params=first.get_weights(),
        strategy="dp",
        seed=7,
    )
    second.init(x)
    tree_allclose(second.get_weights(), first.get_weights())
    assert second.evaluate((x, y)) == pytest.approx(first.evaluate((x, y)), rel=1e-5)


def test_init_is_idempotent_and_params_are_host_arrays():
    x, _ = make_classification(8)
    trainer = tk.Trainer(MLP(), loss="mse", optimizer=optax.sgd(0.1), strategy="dp")
    state = trainer.init(x)
    assert trainer.init((x, None)) is state
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(trainer.params))


class _Dropped(nnx.Module):
    """Its output is a dropout mask times its weights: a weight gets a gradient only where the
    step's mask keeps it."""

    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jnp.ones(256))
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x, train: bool = False):
        return self.drop(x * self.w)


@pytest.mark.parametrize(
    "rngs",
    [lambda: nnx.Rngs(0), lambda: nnx.Rngs(0, dropout=1), lambda: nnx.Rngs(params=0, dropout=1)],
    ids=["Rngs(0)", "Rngs(0,dropout)", "Rngs(params,dropout)"],
)
def test_nnx_dropout_draws_new_masks_every_step_whatever_the_streams(rngs):
    x = np.ones((4, 256), np.float32)
    trainer = tk.Trainer(_Dropped(rngs()), loss="mse", optimizer=optax.sgd(1.0), strategy="single")
    trainer.fit((x, np.zeros_like(x)), batch_size=1, epochs=1, shuffle=False, verbose=0)
    never = float(np.mean(np.asarray(trainer.params["w"]) == 1.0))  # never kept by any of the 4 masks
    assert never < 0.2, f"{never:.0%} of the weights were dropped at every step: the mask did not change"
