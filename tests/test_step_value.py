"""The train step as a value (#82): ``tk.Step``, a frozen dataclass whose fields are its hyperparameters,
given as ``Trainer(step=...)``; the ``train_step`` override kept as a thin adapter over the same seam."""

import dataclasses
import warnings

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from conftest import load_example, strategy_table

import trainkit as tk
from trainkit.core import override_step

gan = load_example("gan")
IMAGES = gan.digits(100)  # with batch 32: three full batches and one of 4 real rows
STRATEGIES = strategy_table(min_shard_size=64)


def adam():
    return optax.adam(1e-3, b1=0.5, eps=1e-6)  # eps above a dead unit's last bit (tests/test_custom_training.py)


def fit(strategy, *, step=None, epochs=2, **options):
    optimizer = {"generator": adam(), "discriminator": adam()}
    if step is None:
        trainer = gan.GANTrainer(gan.GAN(), optimizer=optimizer, strategy=STRATEGIES[strategy](), **options)
    else:
        trainer = tk.Trainer(gan.GAN(), optimizer=optimizer, strategy=STRATEGIES[strategy](), step=step, **options)
    history = trainer.fit(IMAGES, batch_size=32, epochs=epochs, shuffle=False, verbose=0)
    return trainer, history.history


@pytest.mark.parametrize("strategy", ["single", "dp8", "fsdp8", "hybrid2x4_fsdp"])
def test_a_gan_as_a_step_value_equals_the_same_gan_as_a_train_step_override(strategy):
    value, value_logs = fit(strategy, step=gan.GANStep())
    override, override_logs = fit(strategy)
    assert isinstance(value.step, gan.GANStep) and isinstance(override.step, override_step.OverrideStep)
    assert sorted(value_logs) == sorted(override_logs) == ["d_loss", "g_loss"]
    for name in value_logs:
        np.testing.assert_allclose(value_logs[name], override_logs[name], rtol=1e-7, atol=1e-7, err_msg=name)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7), value.params, override.params)


@dataclasses.dataclass(frozen=True)
class Scaled(tk.Step):
    """A regression whose loss is scaled by a hyperparameter (under SGD: a learning rate of its own)."""

    scale: float = 1.0

    def train(self, state, batch, rng):
        def loss_fn(params):
            out, _ = state.apply(params, state.model_state, batch["x"], rng=rng, train=True)
            return state.mean(self.scale * ((out[:, 0] - batch["y"]) ** 2), batch)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads), {"loss": loss}


def regression(step, epochs=1, trainer=None):
    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    trainer = trainer or tk.Trainer(nn.Dense(1), optimizer=optax.sgd(0.1), strategy="single", step=step)
    trainer.fit(x, x.sum(axis=1), batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return trainer


def test_a_changed_hyperparameter_is_a_new_value_traced_again():
    trainer = regression(Scaled(1.0))
    assert trainer.step == Scaled(1.0)
    trainer.step = dataclasses.replace(trainer.step, scale=0.5)
    before = trainer.get_weights()
    with pytest.warns(UserWarning, match=r"scale: 1.0 -> 0.5.*traced again"):
        regression(None, trainer=trainer)
    fresh = tk.Trainer(nn.Dense(1), optimizer=optax.sgd(0.1), strategy="single", step=Scaled(0.5), params=before)
    jax.tree.map(np.testing.assert_allclose, trainer.get_weights(), regression(None, trainer=fresh).get_weights())
    trainer.step = Scaled(np.float32(0.25))  # a NumPy scalar: a value like any number
    with pytest.warns(UserWarning, match=r"scale: 0.5 -> 0.25"):
        regression(None, trainer=trainer)
    trainer.step = Scaled(0.25)  # an equal value: nothing to trace again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        regression(None, trainer=trainer)
    assert trainer.global_step == 16


@dataclasses.dataclass(frozen=True)
class Keeps(gan.GANStep):
    def train(self, state, batch, rng):
        state, logs = super().train(state, batch, rng)
        self.last = logs["d_loss"]  # a tracer of one trace kept on the value
        return state, logs


def test_a_value_set_on_the_step_while_traced_is_refused_by_name():
    with pytest.raises(ValueError, match=r"train_step set self.last while trainkit traced it.*in the logs"):
        fit("single", step=Keeps(), epochs=1)


class Plain(tk.Step):
    def train(self, state, batch, rng):
        return state, {}


@dataclasses.dataclass
class NotFrozen(tk.Step):
    beta: float = 1.0

    def train(self, state, batch, rng):
        return state, {}


@dataclasses.dataclass(frozen=True)
class NoTrain(tk.Step):
    beta: float = 1.0


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (lambda: lambda state, batch, rng: (state, {}), r"step= takes a tk.Step.*received function"),
        (Plain, r"Plain is a tk.Step but not a frozen dataclass: declare it @dataclasses.dataclass\(frozen=True\)"),
        (NotFrozen, r"NotFrozen is a tk.Step but not a frozen dataclass"),
        (NoTrain, r"NoTrain defines no train\(self, state, batch, rng\)"),
    ],
    ids=["function", "plain_class", "not_frozen", "no_train"],
)
def test_a_step_that_is_not_a_frozen_step_value_is_refused_when_the_trainer_is_built(step, message):
    with pytest.raises(TypeError, match=message):
        tk.Trainer(gan.GAN(), optimizer=adam(), strategy="single", step=step())


def test_a_step_value_beside_a_train_step_override_or_of_another_class_is_refused():
    with pytest.raises(TypeError, match=r"GANTrainer overrides train_step or test_step and was given step= too"):
        gan.GANTrainer(gan.GAN(), optimizer=adam(), strategy="single", step=gan.GANStep())
    trainer = tk.Trainer(gan.GAN(), optimizer=adam(), strategy="single", step=gan.GANStep())
    with pytest.raises(TypeError, match=r"trainer.step = Keeps\(...\) replaces a GANStep"):
        trainer.step = Keeps()
    override = gan.GANTrainer(gan.GAN(), optimizer=adam(), strategy="single")
    with pytest.raises(TypeError, match=r"runs its train_step / test_step overrides: change the values they read"):
        override.step = gan.GANStep()


@dataclasses.dataclass(frozen=True)
class Judged(gan.GANStep):
    def test(self, state, batch, rng):
        logits = state.apply(state.params, state.model_state, batch["x"], rng=rng, train=False, method="discriminate")
        return {"real_accuracy": state.mean((logits[0] > 0).astype("float32"), batch)}


def test_a_steps_own_test_evaluates_and_one_without_a_loss_or_test_names_the_fix():
    trainer, _ = fit("dp8", step=Judged(), epochs=1)
    reference, _ = fit("single", step=Judged(), epochs=1)
    results = [t.evaluate(IMAGES, batch_size=32, return_dict=True) for t in (trainer, reference)]
    assert sorted(results[0]) == ["real_accuracy"]
    np.testing.assert_allclose(results[0]["real_accuracy"], results[1]["real_accuracy"], rtol=1e-6)
    untested = tk.Trainer(gan.GAN(), optimizer={"generator": adam(), "discriminator": adam()}, step=gan.GANStep())
    with pytest.raises(NotImplementedError, match=r"run the step's test\(state, batch, rng\).*or pass loss="):
        untested.fit(IMAGES, batch_size=32, validation_data=(IMAGES[:32],), verbose=0)
    assert untested.global_step == 0


@dataclasses.dataclass(frozen=True)
class Warmed(gan.GANStep):
    """The GAN, or with ``frozen_generator`` the generator given the discriminator's gradients (all zero for it)."""

    frozen_generator: bool = False

    def train(self, state, batch, rng):
        if not self.frozen_generator:
            return super().train(state, batch, rng)
        z = state.normal(rng, batch, (self.latent,))
        fake = state.apply(state.params, state.model_state, z, rng=rng, train=True, method="generate")[0]

        def d_loss_fn(params):
            logits = state.apply(params, state.model_state, fake, rng=rng, train=True, method="discriminate")[0]
            return state.mean(gan.bce(logits, 0.0), batch)

        d_loss, grads = jax.value_and_grad(d_loss_fn)(state.params)
        return state.apply_gradients(grads, "generator"), {"d_loss": d_loss}


def test_a_new_step_value_is_audited_again_before_its_first_update():
    """#82 (CU12): the first-batch audit ran once per trainer, so a second fit's step went unchecked; it now runs
    once per step value: a replaced value that updates a group on all-zero gradients is refused before training."""
    trainer, _ = fit("single", step=Warmed(), epochs=1)
    trainer.step = dataclasses.replace(trainer.step, frozen_generator=True)
    with pytest.raises(ValueError, match=r"updates 'generator' on gradients that are all zero"):
        with pytest.warns(UserWarning, match=r"frozen_generator: False -> True"):
            trainer.fit(IMAGES, batch_size=32, verbose=0)
    assert trainer.global_step == 4


def test_the_built_in_step_is_a_value_compiled_through_the_seam_of_every_step():
    """#82: the built-in step is a ``tk.Step`` value too (``LossStep``: the loss, the metrics and the step's options
    its fields), asked for its compiled form as a user's step is; run alone, it trains as ``fit`` does."""
    from trainkit.core.loss_step import LossStep

    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5]], np.float32)
    fitted = tk.Trainer(nn.Dense(1), loss="mse", optimizer=optax.sgd(0.1), strategy="single")
    fitted.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    trainer = tk.Trainer(nn.Dense(1), loss="mse", optimizer=optax.sgd(0.1), strategy="single")
    built = trainer.program.steps.step_value("train")
    assert isinstance(built, LossStep) and not built.trains and trainer.step is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.metric_fns = {}  # type: ignore[misc]
    state = trainer.program.create_state(tk.SingleDevice(), x[:1])
    step = jax.jit(built.train_metrics(trainer.program.steps.step_facts(None)))
    state, metrics = step(state, {"x": x, "y": y, "mask": np.ones(8, np.float32)})
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), state.params, fitted.params)
    assert int(state.step) == 1 and float(metrics["loss"].compute()) > 0
    own = tk.Trainer(nn.Dense(1), loss="mse", optimizer=optax.sgd(0.1), step=Scaled()).program.steps
    assert not isinstance(own.step_value("train"), LossStep) and isinstance(own.step_value("eval"), LossStep)
