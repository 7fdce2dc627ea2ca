"""Four recipes first written for Keras 3, ported with the state's helpers (#69): WGAN-GP with
five critic steps and a gradient penalty, a conditional GAN, DPO against a frozen reference
copied from the policy, BYOL with an EMA target kept in the state. Each trains the same under
SingleDevice, DataParallel and FSDP on 8 devices, and resumes from a checkpoint bit-exactly."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import strategy_table, tree_allclose

import trainkit as tk

STRATEGIES = strategy_table(min_shard_size=16)
RNG = np.random.default_rng(0)
X = (RNG.normal(size=(90, 8)) + np.arange(8) / 4).astype(np.float32)  # batches of 32: the last pads 6 rows
LABELS = (np.arange(90) % 3).astype(np.int32)
PREFERENCES = np.stack([RNG.integers(0, 4, 90), RNG.integers(0, 4, 90)], axis=1).astype(np.int32)


def mlp(*sizes):
    return nn.Sequential([layer for size in sizes[:-1] for layer in (nn.Dense(size), nn.relu)] + [nn.Dense(sizes[-1])])


class GAN(nn.Module):
    """A generator of 8 values from 4 (and a label, when conditional) and a critic of 8 values."""

    conditional: bool = False

    def setup(self):
        self.generator, self.critic = mlp(16, 8), mlp(16, 1)

    def _with(self, x, labels):
        return x if not self.conditional else jnp.concatenate([x, jax.nn.one_hot(labels, 3)], axis=-1)

    def generate(self, z, labels=None):
        return self.generator(self._with(z, labels))

    def judge(self, x, labels=None):
        return self.critic(self._with(x, labels))[:, 0]

    def __call__(self, x):
        labels = jnp.zeros(x.shape[0], jnp.int32)
        return self.judge(x, labels), self.generate(jnp.zeros((x.shape[0], 4)), labels)


class WGANGP(tk.Trainer):
    critic_steps, penalty = 5, 10.0

    def train_step(self, state, batch, rng):
        labels = batch.get("y")

        def run(params, x, method):
            return state.apply(params, state.model_state, x, labels, rng=rng, train=True, method=method)[0]

        def critic_rows(params, z, eps):
            fake = jax.lax.stop_gradient(run(params, z, "generate"))
            mixed = eps * batch["x"] + (1 - eps) * fake
            slopes = jax.grad(lambda m: run(params, m, "judge").sum())(mixed)  # each row's own gradient
            penalty = (jnp.sqrt((slopes**2).sum(-1) + 1e-12) - 1.0) ** 2
            return run(params, fake, "judge") - run(params, batch["x"], "judge") + self.penalty * penalty

        def critic_loss(params, z, eps):
            return state.mean(critic_rows(params, z, eps), batch)

        for k in range(self.critic_steps):  # five critic updates, each on its own noise
            key = jax.random.fold_in(rng, k)
            z, eps = (
                state.normal(key, batch, (4,)),
                jax.nn.sigmoid(state.normal(jax.random.fold_in(key, 1), batch, (1,))),
            )
            c_loss, grads = jax.value_and_grad(critic_loss)(state.params, z, eps)
            state = state.apply_gradients(grads, "critic")
        z = state.normal(jax.random.fold_in(rng, self.critic_steps), batch, (4,))
        g_loss, grads = jax.value_and_grad(lambda p: state.mean(-run(p, run(p, z, "generate"), "judge"), batch))(
            state.params
        )
        return state.apply_gradients(grads, "generator"), {"c_loss": c_loss, "g_loss": g_loss}


class ConditionalGAN(tk.Trainer):
    def train_step(self, state, batch, rng):
        labels, z = batch["y"], state.normal(rng, batch, (4,))

        def run(params, x, method):
            return state.apply(params, state.model_state, x, labels, rng=rng, train=True, method=method)[0]

        def bce(logits, label):
            return optax.sigmoid_binary_cross_entropy(logits, jnp.full_like(logits, label))

        def d_rows(params):
            fake = jax.lax.stop_gradient(run(params, z, "generate"))
            return bce(run(params, batch["x"], "judge"), 1.0) + bce(run(params, fake, "judge"), 0.0)

        d_loss, grads = jax.value_and_grad(lambda p: state.mean(d_rows(p), batch))(state.params)
        state = state.apply_gradients(grads, "critic")
        g_loss, grads = jax.value_and_grad(
            lambda p: state.mean(bce(run(p, run(p, z, "generate"), "judge"), 1.0), batch)
        )(state.params)
        return state.apply_gradients(grads, "generator"), {"d_loss": d_loss, "g_loss": g_loss}


class Pair(nn.Module):
    """A policy and a reference of the same shape (DPO)."""

    def setup(self):
        self.policy, self.reference = mlp(16, 4), mlp(16, 4)

    def both(self, x):
        return self.policy(x), self.reference(x)

    def __call__(self, x):
        if self.is_initializing():
            self.reference(x)
        return self.policy(x)


class DPO(tk.Trainer):
    beta = 0.5

    def train_step(self, state, batch, rng):
        chosen, rejected = batch["y"][:, 0], batch["y"][:, 1]

        def rows(params):
            (policy, reference), _ = state.apply(
                params, state.model_state, batch["x"], rng=rng, train=True, method="both"
            )
            policy, reference = jax.nn.log_softmax(policy), jax.nn.log_softmax(reference)
            pick = lambda logp, i: jnp.take_along_axis(logp, i[:, None], axis=1)[:, 0]  # noqa: E731
            margin = (
                pick(policy, chosen) - pick(policy, rejected) - (pick(reference, chosen) - pick(reference, rejected))
            )
            return -jax.nn.log_sigmoid(self.beta * margin)

        loss, grads = jax.value_and_grad(lambda p: state.mean(rows(p), batch))(state.params)
        return state.apply_gradients(grads), {"dpo_loss": loss}


class Siamese(nn.Module):
    """BYOL's online encoder and predictor, and a target encoder of the encoder's shape."""

    def setup(self):
        self.encoder, self.predictor, self.target = mlp(16, 4), mlp(4), mlp(16, 4)

    def online(self, x):
        return self.predictor(self.encoder(x))

    def targeted(self, x):
        return self.target(x)

    def __call__(self, x):
        if self.is_initializing():
            self.online(x), self.targeted(x)
        return self.encoder(x)


class BYOL(tk.Trainer):
    decay = 0.9

    def train_step(self, state, batch, rng):
        views = [batch["x"] + 0.3 * state.normal(jax.random.fold_in(rng, v), batch, (8,)) for v in (0, 1)]

        def rows(params):
            def run(x, method):
                return state.apply(params, state.model_state, x, rng=rng, train=True, method=method)[0]

            def cosine(a, b):
                return (a * b).sum(-1) / jnp.sqrt((a**2).sum(-1) * (b**2).sum(-1) + 1e-12)

            p1, p2 = run(views[0], "online"), run(views[1], "online")
            t1, t2 = (jax.lax.stop_gradient(run(v, "targeted")) for v in views)
            return (2 - 2 * cosine(p1, t2)) + (2 - 2 * cosine(p2, t1))

        loss, grads = jax.value_and_grad(lambda p: state.mean(rows(p), batch))(state.params)
        state = state.apply_gradients(grads)  # the online network: the target is frozen
        target = jax.tree.map(
            lambda t, o: self.decay * t + (1 - self.decay) * o, state.params["target"], state.params["encoder"]
        )
        return state.replace(params={**state.params, "target": target}), {"byol_loss": loss}


def adam_groups():
    return {"generator": optax.adam(1e-3, b1=0.5), "critic": optax.adam(1e-3, b1=0.5)}


RECIPES = {  # name: (build(strategy), x, y, the copy a run starts from)
    "wgan_gp": (lambda s: WGANGP(GAN(), optimizer=adam_groups(), strategy=s), X, None, None),
    "conditional_gan": (
        lambda s: ConditionalGAN(GAN(conditional=True), optimizer=adam_groups(), strategy=s), X, LABELS, None
    ),
    "dpo": (
        lambda s: DPO(Pair(), optimizer=optax.adam(1e-2), strategy=s, trainable=r"^policy/"),
        X, PREFERENCES, ("policy/", "reference/"),
    ),
    "byol": (
        lambda s: BYOL(Siamese(), optimizer=optax.adam(1e-2), strategy=s, trainable=r"^(encoder|predictor)/"),
        X, None, ("encoder/", "target/"),
    ),
}  # fmt: skip


def started(name, strategy):
    build, x, y, copied = RECIPES[name]
    trainer = build(strategy)
    trainer.init(x if y is None else (x, y))
    if copied is not None:  # the reference (or target) starts as a copy: one call
        tk.weights.copy(trainer, source=copied[0], into=copied[1])
    return trainer


def fit(trainer, name, epochs=2, initial_epoch=0):
    _, x, y, _ = RECIPES[name]
    return trainer.fit(
        x, y, batch_size=32, epochs=epochs, initial_epoch=initial_epoch, shuffle=False, verbose=0
    ).history


@pytest.fixture(scope="module", params=list(RECIPES))
def single(request):
    trainer = started(request.param, "single")
    before = jax.tree.map(np.asarray, trainer.params)
    return request.param, trainer, before, fit(trainer, request.param)


def test_each_recipe_trains_and_keeps_what_it_declares(single):
    name, trainer, before, history = single
    assert all(np.isfinite(v).all() for v in history.values()) and len(next(iter(history.values()))) == 2
    if name == "dpo":  # the reference: the policy's first weights, bit for bit, never trained
        jax.tree.map(np.testing.assert_array_equal, trainer.params["reference"], before["policy"])
        first_step = started(name, "single").train_on_batch(X[:32], PREFERENCES[:32], return_dict=True)
        assert first_step["dpo_loss"] == pytest.approx(np.log(2), rel=1e-6)  # the policy starts as its reference
        assert history["dpo_loss"][1] < history["dpo_loss"][0]
    if name == "byol":  # the target moved, as the online encoder's average
        moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), trainer.params["target"], before["target"])
        assert all(jax.tree.leaves(moved))


@pytest.mark.parametrize("strategy", ["dp8", "fsdp8"])
def test_each_recipe_equals_single_device(single, strategy):
    name, reference, _, expected = single
    trainer = started(name, STRATEGIES[strategy]())
    history = fit(trainer, name)
    for key, values in expected.items():
        np.testing.assert_allclose(history[key], values, rtol=1e-5, atol=1e-6, err_msg=key)
    tree_allclose(trainer.params, reference.params, rtol=1e-4, atol=1e-5)


def test_each_recipe_resumes_bit_exactly(single, tmp_path):
    name, reference, _, expected = single
    first = started(name, "single")
    fit(first, name, epochs=1)
    first.save(tmp_path / "checkpoint")
    resumed = RECIPES[name][0]("single")
    _, x, y, _ = RECIPES[name]
    resumed.init(x if y is None else (x, y))
    resumed.load(tmp_path / "checkpoint")
    history = fit(resumed, name, epochs=2, initial_epoch=1)
    for key, values in expected.items():
        assert history[key] == values[1:], key
    jax.tree.map(np.testing.assert_array_equal, resumed.params, reference.params)
