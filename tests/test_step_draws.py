"""Random draws over the batch in a step of the user's own (#82, MixUp): the partners drawn by one permutation of
the global batch (``state.shuffled``) and a per-batch Beta weight give the one-device result on every strategy."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import strategy_table

import trainkit as tk

STRATEGIES = strategy_table(min_shard_size=16)
rng = np.random.default_rng(0)
X = rng.normal(size=(90, 6)).astype(np.float32)  # batches of 32: the last one pads 6 rows
Y = (X[:, 0] + X[:, 1] > 0).astype(np.int32)


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.tanh(nn.Dense(8)(x)))


@dataclasses.dataclass(frozen=True)
class MixUp(tk.Step):
    """MixUp (Zhang et al.): each row mixed with a partner row by one Beta(alpha, alpha) weight per batch."""

    alpha: float = 0.4

    def train(self, state, batch, rng):
        weight_key, partner_key = jax.random.split(rng)
        weight = jax.random.beta(weight_key, self.alpha, self.alpha)  # one per batch: the same on every device
        x = weight * batch["x"] + (1 - weight) * state.shuffled(batch["x"], partner_key, batch)
        labels, partner_labels = batch["y"], state.shuffled(batch["y"], partner_key, batch)

        def loss_fn(params):
            logits, _ = state.apply(params, state.model_state, x, rng=rng, train=True)
            ce = optax.softmax_cross_entropy_with_integer_labels
            return state.mean(weight * ce(logits, labels) + (1 - weight) * ce(logits, partner_labels), batch)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads), {"loss": loss}


def fit(strategy):
    trainer = tk.Trainer(Classifier(), optimizer=optax.sgd(0.1), strategy=STRATEGIES[strategy](), step=MixUp())
    history = trainer.fit(X, Y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    return trainer, history


@pytest.fixture(scope="module")
def single():
    return fit("single")


@pytest.mark.parametrize("strategy", ["dp8", "fsdp8", "hybrid2x4_fsdp"])
def test_mixup_partners_and_weight_are_the_one_device_draws_on_every_strategy(single, strategy):
    (reference, expected), (trainer, history) = single, fit(strategy)
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), trainer.params, reference.params)


@pytest.mark.parametrize("padded", [0, 3])
def test_the_partners_are_one_permutation_of_the_global_batchs_real_rows(padded):
    from trainkit.core import step_helpers

    x, mask = jnp.arange(8.0), jnp.arange(8) < 8 - padded
    key = jax.random.key(3)
    whole = np.asarray(step_helpers.shuffled(x, key, {"mask": mask}, None))
    assert sorted(whole[: 8 - padded].tolist()) == list(range(8 - padded))  # each real row a real row's partner once
    assert whole[8 - padded :].tolist() == list(range(8 - padded, 8))  # a padded row its own
    assert not np.array_equal(whole, np.arange(8))
    halves = jax.vmap(lambda x, m: step_helpers.shuffled(x, key, {"mask": m}, "data"), axis_name="data")
    np.testing.assert_array_equal(np.asarray(halves(x.reshape(2, 4), mask.reshape(2, 4))).reshape(-1), whole)


@dataclasses.dataclass(frozen=True)
class DeviceMixUp(MixUp):
    """MixUp as a new user writes it: partners from ``jax.random.permutation`` over the batch it sees."""

    def train(self, state, batch, rng):
        weight_key, partner_key = jax.random.split(rng)
        weight = jax.random.beta(weight_key, self.alpha, self.alpha)
        partners = jax.random.permutation(partner_key, batch["x"].shape[0])  # each device's rows under DataParallel
        x = weight * batch["x"] + (1 - weight) * batch["x"][partners]

        def loss_fn(params):
            logits, _ = state.apply(params, state.model_state, x, rng=rng, train=True)
            ce = optax.softmax_cross_entropy_with_integer_labels
            return state.mean(weight * ce(logits, batch["y"]) + (1 - weight) * ce(logits, batch["y"][partners]), batch)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads), {"loss": loss}


def test_partners_drawn_over_each_devices_rows_are_refused_by_name_before_the_first_step():
    """#82 (MixUp): under DataParallel each device drew over its own rows, 0.026-0.030 from one device, silently;
    the audit now runs the step split as the devices run it and whole, and refuses where the logs differ."""
    trainer = tk.Trainer(Classifier(), optimizer=optax.sgd(0.1), strategy=STRATEGIES["dp8"](), step=DeviceMixUp())
    with pytest.raises(ValueError, match=r"'loss' on the first batch .* split over the 8 devices.*state.shuffled"):
        trainer.fit(X[:64], Y[:64], batch_size=32, epochs=1, verbose=0)
    assert trainer.global_step == 0
    alone = tk.Trainer(Classifier(), optimizer=optax.sgd(0.1), strategy=STRATEGIES["fsdp8"](), step=DeviceMixUp())
    alone.fit(X[:64], Y[:64], batch_size=32, epochs=1, verbose=0)  # FSDP's step sees the global batch: as written
    assert alone.global_step == 2
