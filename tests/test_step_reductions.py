"""#82 (CU14): a user's ``train_step`` that reduces with ``jnp.mean`` over its batch gets the one-device
gradient on every strategy wherever no row is padded: under DataParallel (pmap) the gradients are
averaged over the devices, as pmap's data parallelism averages per-device means, and ``state.mean``'s
gradients are scaled for it, so both spellings train to SingleDevice's numbers. Before, each device's
mean was summed over the 8 devices: 8x the gradient, silently."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import trainkit as tk

X = np.random.default_rng(0).normal(size=(96, 4)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5, 3.0], np.float32))[:, None]


class MeanOverItsRows(tk.Trainer):
    """Reduces with jnp.mean: each device's rows under pmap, the global batch under jit."""

    def train_step(self, state, batch, rng):
        def loss(params):
            out = state.apply(params, state.model_state, batch["x"], rng=rng, train=True)[0]
            return jnp.mean((out - batch["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads), {"loss": value}


class MeanByTheState(tk.Trainer):
    """The same loss reduced by state.mean (padded rows left out)."""

    def train_step(self, state, batch, rng):
        def loss(params):
            out = state.apply(params, state.model_state, batch["x"], rng=rng, train=True)[0]
            return state.mean(((out - batch["y"]) ** 2)[:, 0], batch)

        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads), {"loss": value}


def trained(trainer_class, strategy, rows=96):
    trainer = trainer_class(nn.Dense(1), optimizer=optax.sgd(0.05), strategy=strategy)
    history = trainer.fit(X[:rows], Y[:rows], batch_size=32, epochs=2, shuffle=False, verbose=0)
    return jax.tree.map(np.asarray, trainer.params), history.history["loss"]


@pytest.fixture(scope="module")
def single():
    return trained(MeanOverItsRows, "single")


@pytest.mark.parametrize("strategy", ["data_parallel", "fsdp"])
@pytest.mark.parametrize("trainer_class", [MeanOverItsRows, MeanByTheState], ids=["jnp.mean", "state.mean"])
def test_a_mean_over_the_batch_trains_as_on_one_device_on_every_strategy(single, trainer_class, strategy):
    params, losses = trained(trainer_class, strategy)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), params, single[0])
    np.testing.assert_allclose(losses, single[1], rtol=1e-6)  # per-device means averaged: the global mean
