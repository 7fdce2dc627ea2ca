"""The user's own step, finished (#69): the helpers on the state it threads, and the silent
mistakes of a ported recipe refused when the step is traced, each naming its fix."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import trainkit as tk
from trainkit.core import step_state
from trainkit.core.state import TrainState

X = np.random.default_rng(0).normal(size=(96, 4)).astype(np.float32)


class TwoParts(nn.Module):
    """A generator of 4 values from 2 and a critic of 4 values."""

    def setup(self):
        self.generator, self.critic = nn.Dense(4), nn.Dense(1)

    def generate(self, z):
        return self.generator(z)

    def judge(self, x):
        return self.critic(x)[:, 0]

    def __call__(self, x):
        return self.judge(x), self.generate(jnp.zeros((x.shape[0], 2)))


def groups():
    return {"generator": optax.adam(1e-2), "critic": optax.adam(1e-2)}


class Alternating(tk.Trainer):
    """A critic's update, then the generator's against the updated critic (a GAN's shape)."""

    def losses(self, state, batch, rng):
        z = state.normal(rng, batch, (2,))

        def run(params, x, method):
            return state.apply(params, state.model_state, x, rng=rng, train=True, method=method)[0]

        def critic_rows(params):
            fake = jax.lax.stop_gradient(run(params, z, "generate"))
            return run(params, fake, "judge") - run(params, batch["x"], "judge")

        def generator_rows(params):
            return -run(params, run(params, z, "generate"), "judge")

        return critic_rows, generator_rows

    def train_step(self, state, batch, rng):
        critic_rows, generator_rows = self.losses(state, batch, rng)
        c_loss, grads = jax.value_and_grad(lambda p: state.mean(critic_rows(p), batch))(state.params)
        state = state.apply_gradients(grads, "critic")
        g_loss, grads = jax.value_and_grad(lambda p: state.mean(generator_rows(p), batch))(state.params)
        state = state.apply_gradients(grads, "generator")
        return state, {"c_loss": c_loss, "g_loss": g_loss}


def fit(trainer_class, rows=96, batch_size=32, epochs=1, strategy="single", **options):
    trainer = trainer_class(TwoParts(), optimizer=groups(), strategy=strategy, **options)
    history = trainer.fit(X[:rows], batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return trainer, history.history


def test_the_helpers_live_on_the_state_and_train_both_groups():
    trainer, history = fit(Alternating)
    assert sorted(history) == ["c_loss", "g_loss"]
    assert not hasattr(tk.Trainer, "mean") and not hasattr(tk.Trainer, "apply_gradients")
    assert not any(isinstance(v, type(None)) for v in jax.tree.leaves(trainer.state))


def test_the_step_state_copies_every_field_of_the_train_state():
    state = TrainState.create(params={"w": jnp.ones(2)}, opt_state=(), model_state={}, seed=0)
    fields = step_state._fields(state)
    assert set(fields) == {f.name for f in TrainState.__dataclass_fields__.values()}
    assert step_state.StepState.of(state, None).plain() == state


class OldMean(Alternating):
    def train_step(self, state, batch, rng):
        critic_rows, _ = self.losses(state, batch, rng)
        loss, grads = jax.value_and_grad(lambda p: self.mean(critic_rows(p), batch))(state.params)
        return state.apply_gradients(grads, "critic"), {"loss": loss}


class OldUpdate(Alternating):
    def train_step(self, state, batch, rng):
        grads = jax.tree.map(jnp.zeros_like, state.params)
        return self.apply_gradients(state, grads, "critic"), {}


class OldApply(Alternating):
    def train_step(self, state, batch, rng):
        out, _ = self.apply(state.params, state.model_state, batch["x"], rng=rng, train=True, method="judge")
        return state, {"out": state.mean(out, batch)}


@pytest.mark.parametrize(
    ("trainer_class", "message"),
    [
        (OldMean, r"OldMean.train_step calls self.mean\(...\).*Write state.mean\(...\) instead of self.mean"),
        (OldUpdate, r"self.apply_gradients.*state = state.apply_gradients\(grads, group=...\)"),
        (OldApply, r"calls self.apply\(...\).*Write state.apply\(...\)"),
    ],
    ids=["mean", "apply_gradients", "apply"],
)
def test_the_old_self_spelling_is_refused_when_the_step_is_traced(trainer_class, message):
    """The step runs with ``self`` a frozen view of the trainer, which names the helper's new home when read
    (#82: no bytecode reading, so no longer when the trainer is built: at the first trace, before any step)."""
    trainer = trainer_class(TwoParts(), optimizer=groups(), strategy="single")
    with pytest.raises(TypeError, match=message):
        trainer.fit(X, batch_size=32, verbose=0)
    assert trainer.global_step == 0


class UpdateNotKept(Alternating):
    def train_step(self, state, batch, rng):
        critic_rows, generator_rows = self.losses(state, batch, rng)
        c_loss, grads = jax.value_and_grad(lambda p: state.mean(critic_rows(p), batch))(state.params)
        state.apply_gradients(grads, "critic")  # no "state ="
        g_loss, grads = jax.value_and_grad(lambda p: state.mean(generator_rows(p), batch))(state.params)
        state = state.apply_gradients(grads, "generator")
        return state, {"c_loss": c_loss, "g_loss": g_loss}


class OldStateReturned(Alternating):
    def train_step(self, state, batch, rng):
        critic_rows, _ = self.losses(state, batch, rng)
        c_loss, grads = jax.value_and_grad(lambda p: state.mean(critic_rows(p), batch))(state.params)
        new_state = state.apply_gradients(grads, "critic")
        del new_state
        return state, {"c_loss": c_loss}


class OptimizerStateDropped(Alternating):
    def train_step(self, state, batch, rng):
        critic_rows, _ = self.losses(state, batch, rng)
        c_loss, grads = jax.value_and_grad(lambda p: state.mean(critic_rows(p), batch))(state.params)
        updated = state.apply_gradients(grads, "critic")
        return state.replace(params=updated.params), {"c_loss": c_loss}


class EveryGroupAfterOne(Alternating):
    def train_step(self, state, batch, rng):
        critic_rows, generator_rows = self.losses(state, batch, rng)
        c_loss, grads = jax.value_and_grad(lambda p: state.mean(critic_rows(p), batch))(state.params)
        state = state.apply_gradients(grads, "critic")
        g_loss, grads = jax.value_and_grad(lambda p: state.mean(generator_rows(p), batch))(state.params)
        state = state.apply_gradients(grads)  # no group: the critic again, on the generator's loss
        return state, {"c_loss": c_loss, "g_loss": g_loss}


@pytest.mark.parametrize(
    ("trainer_class", "message"),
    [
        (UpdateNotKept, r"update of group 'critic'.*returned the parameters it was given.*state = state.apply_gradi"),
        (OldStateReturned, r"update of group 'critic'.*returned the parameters it was given"),
        (OptimizerStateDropped, r"update of group 'critic'.*returned the optimizer state it was given"),
        (EveryGroupAfterOne, r"after state.apply_gradients\(..., group='critic'\).*Name the group each update is"),
    ],
    ids=["not_kept", "old_returned", "optimizer_state_dropped", "no_group_after_a_group"],
)
def test_an_update_thrown_away_or_doubled_is_refused_naming_the_group(trainer_class, message):
    with pytest.raises(ValueError, match=message):
        fit(trainer_class)


class SeveralCriticSteps(Alternating):
    def train_step(self, state, batch, rng):
        critic_rows, _ = self.losses(state, batch, rng)
        mean = state.mean  # the same facts on every state the step threads
        for _ in range(3):  # WGAN's several critic steps: several updates of one group stay allowed
            c_loss, grads = jax.value_and_grad(lambda p: mean(critic_rows(p), batch))(state.params)
            state = state.apply_gradients(grads, "critic")
        return state, {"c_loss": c_loss}


def test_several_updates_of_one_group_in_a_step_are_allowed():
    trainer, history = fit(SeveralCriticSteps)
    assert len(history["c_loss"]) == 1


class GroupSubTree(Alternating):
    def train_step(self, state, batch, rng):
        critic_rows, _ = self.losses(state, batch, rng)
        c_loss, grads = jax.value_and_grad(lambda p: state.mean(critic_rows(p), batch))(state.params)
        return state.apply_gradients(grads["critic"], "critic"), {"c_loss": c_loss}


class WholeTree(GroupSubTree):
    def train_step(self, state, batch, rng):
        critic_rows, _ = self.losses(state, batch, rng)
        c_loss, grads = jax.value_and_grad(lambda p: state.mean(critic_rows(p), batch))(state.params)
        return state.apply_gradients(grads, "critic"), {"c_loss": c_loss}


def test_a_groups_own_sub_tree_of_gradients_updates_that_group():
    sub, _ = fit(GroupSubTree)
    whole, _ = fit(WholeTree)
    jax.tree.map(np.testing.assert_array_equal, sub.params, whole.params)


class MeanOverPadding(Alternating):
    def train_step(self, state, batch, rng):
        critic_rows, _ = self.losses(state, batch, rng)
        c_loss, grads = jax.value_and_grad(lambda p: jnp.mean(critic_rows(p)))(state.params)  # counts padded rows
        return state.apply_gradients(grads, "critic"), {"c_loss": c_loss}


def test_a_mean_counting_padded_rows_is_refused_at_the_first_padded_fit():
    with pytest.raises(ValueError, match=r"counts the rows that pad.*90 rows in batches of 32.*state.mean"):
        fit(MeanOverPadding, rows=90)
    fit(MeanOverPadding, rows=96)  # no batch pads: nothing counted
    fit(SeveralCriticSteps, rows=90)  # state.mean leaves them out


class Leaking(Alternating):
    def train_step(self, state, batch, rng):
        state, logs = super().train_step(state, batch, rng)
        self.last_c_loss = logs["c_loss"]
        return state, logs


def test_an_attribute_set_while_the_step_is_traced_is_refused_and_undone():
    trainer = Leaking(TwoParts(), optimizer=groups(), strategy="single")
    with pytest.raises(ValueError, match=r"train_step set self.last_c_loss while trainkit traced it.*in the logs"):
        trainer.fit(X, batch_size=32, verbose=0)
    assert "last_c_loss" not in vars(trainer)


class Weighted(Alternating):
    beta = 1.0

    def train_step(self, state, batch, rng):
        state, logs = super().train_step(state, batch, rng)
        return state, {**logs, "beta": jnp.float32(self.beta)}


def test_a_value_the_step_read_from_self_that_changed_retraces_with_a_note():
    trainer = Weighted(TwoParts(), optimizer=groups(), strategy="single")
    assert trainer.fit(X, batch_size=32, verbose=0).history["beta"] == [1.0]
    trainer.beta = 0.25
    with pytest.warns(UserWarning, match=r"beta: 1.0 -> 0.25.*traced again"):
        history = trainer.fit(X, batch_size=32, verbose=0).history
    assert history["beta"] == [0.25]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing changed: no note, no trace
        trainer.fit(X, batch_size=32, verbose=0)


class UndeclaredState(Alternating):
    def train_step(self, state, batch, rng):
        new, logs = super().train_step(state, batch, rng)
        target = jax.tree.map(lambda p: 0.99 * p, state.params["critic"])
        return new.replace(model_state={**new.model_state, "ema": target}), logs


class CastTarget(Alternating):
    def train_step(self, state, batch, rng):
        new, logs = super().train_step(state, batch, rng)
        params = {**new.params, "critic": jax.tree.map(lambda p: p.astype(jnp.bfloat16), new.params["critic"])}
        return new.replace(params=params), logs


@pytest.mark.parametrize(
    ("trainer_class", "message"),
    [
        (UndeclaredState, r"model_state with \[\"\['ema'\]\['bias'\]\".*never declared.*'State of your own'"),
        (CastTarget, r"returned params in another dtype.*critic.*bfloat16"),
    ],
    ids=["undeclared_model_state", "dtype"],
)
def test_state_the_trainer_would_drop_or_recast_is_refused(trainer_class, message):
    with pytest.raises(ValueError, match=message):
        fit(trainer_class)


class ReadsTargets(Alternating):
    def train_step(self, state, batch, rng):
        return state, {"y": state.mean(batch["y"], batch)}


def test_a_step_reading_targets_that_fit_did_not_get_names_the_fix():
    with pytest.raises(KeyError, match=r"batch\['y'\]: the batch holds \['mask', 'x'\]; fit.*received no targets"):
        fit(ReadsTargets)


class Conditional(nn.Module):
    """A conditional generator (noise and a label in) beside a critic of the data."""

    def setup(self):
        self.generator, self.critic = nn.Dense(4), nn.Dense(1)

    def generate(self, z, labels):
        return self.generator(jnp.concatenate([z, jax.nn.one_hot(labels, 3)], axis=-1))

    def __call__(self, x):
        return self.critic(x), self.generate(jnp.zeros((x.shape[0], 2)), jnp.zeros(x.shape[0], jnp.int32))


class TwoInputs(tk.Trainer):
    def train_step(self, state, batch, rng):
        labels = jnp.arange(batch["x"].shape[0]) % 3
        z = state.normal(rng, batch, (2,))

        def loss_fn(params):
            out, _ = state.apply(params, state.model_state, z, labels, rng=rng, train=True, method="generate")
            by_name, _ = state.apply(
                params, state.model_state, z, labels=labels, rng=rng, train=True, method="generate"
            )
            return state.mean(((out - batch["x"]) ** 2).sum(-1) + 0 * by_name.sum(-1), batch)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads), {"loss": loss}


def test_state_apply_takes_several_inputs_by_position_or_name():
    trainer = TwoInputs(Conditional(), optimizer=optax.adam(1e-2), strategy="single")
    history = trainer.fit(X, batch_size=32, epochs=3, verbose=0, shuffle=False).history
    assert history["loss"][-1] < history["loss"][0]


class ForgotMethod(Alternating):
    def train_step(self, state, batch, rng):
        z = state.normal(rng, batch, (2,))
        fake, _ = state.apply(state.params, state.model_state, z, rng=rng, train=True)  # method="generate" forgotten
        return state, {"fake": state.mean(fake[0], batch)}


def test_a_forgotten_method_is_named_beside_the_models_error():
    with pytest.raises(
        Exception, match=r"(?s)ran the model's __call__ \(method=None\) on inputs of shapes \[\(32, 2\)\]"
    ):
        fit(ForgotMethod)


class CriticGradientsToTheGenerator(Alternating):
    def train_step(self, state, batch, rng):
        critic_rows, _ = self.losses(state, batch, rng)
        c_loss, grads = jax.value_and_grad(lambda p: state.mean(critic_rows(p), batch))(state.params)
        state = state.apply_gradients(grads, "critic")
        return state.apply_gradients(grads, "generator"), {"c_loss": c_loss}  # the critic's loss: zero for it


class OneGroupsLossToAll(tk.Trainer):
    def train_step(self, state, batch, rng):
        def loss_fn(params):
            return state.mean(
                state.apply(params, state.model_state, batch["x"], rng=rng, train=True, method="judge")[0], batch
            )

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads), {"loss": loss}  # every group: the generator on zero gradients


@pytest.mark.parametrize(
    ("trainer_class", "group"),
    [(CriticGradientsToTheGenerator, "generator"), (OneGroupsLossToAll, "generator")],
    ids=["wrong_group", "every_group"],
)
def test_a_group_updated_on_gradients_its_loss_never_reads_is_refused(trainer_class, group):
    with pytest.raises(ValueError, match=rf"updates '{group}' on gradients that are all zero.*never reads '{group}'"):
        fit(trainer_class)


def test_the_compiled_steps_name_their_phases_for_a_profile():
    import re

    def scopes(text):
        return {part for name in re.findall(r'op_name="([^"]*)"', text) for part in name.split("/")}

    built_in = tk.Trainer(nn.Dense(2), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2),
                          strategy="single")  # fmt: skip
    x = (X[:32], np.zeros((32,), np.int32))
    built_in.init(x)
    found = scopes(built_in.compiled_text(x))
    assert {"loss_and_gradients", "optimizer_update", "apply_updates"} <= found, found
    own, _ = fit(Alternating)
    found = scopes(own.compiled_text(X[:32]))
    assert {"train_step", "apply_gradients_critic", "apply_gradients_generator"} <= found, found


class NamesTheAxis(tk.Trainer):
    def train_step(self, state, batch, rng):
        def loss_fn(params):
            out, _ = state.apply(params, state.model_state, batch["x"], rng=rng, train=True, method="judge")
            return state.mean(out, batch)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        rows = jax.lax.psum(batch["mask"].sum(), "data")  # an advanced step speaks to DataParallel's axis itself
        return state.apply_gradients(grads, "critic"), {"loss": loss, "rows": rows}


def test_a_step_naming_the_device_axis_itself_trains_under_its_strategy():
    _, history = fit(NamesTheAxis, rows=90, strategy="dp")
    assert history["rows"] == [pytest.approx(history["rows"][0])] and history["rows"][0] > 0


class NamesTheAxisCountingPaddedRows(tk.Trainer):
    def train_step(self, state, batch, rng):
        def loss_fn(params):
            out, _ = state.apply(params, state.model_state, batch["x"], rng=rng, train=True, method="judge")
            return jax.lax.pmean(jnp.mean(out), "data")  # the padded rows counted in the mean

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads, "critic"), {"loss": loss}


def test_a_step_naming_the_device_axis_itself_is_audited_under_it():
    """#82: the first-batch audit runs under the strategy's axis (a vmap of one device), so a step that
    names the axis is audited like any other, not skipped (it used to be, found by a NameError)."""
    with pytest.raises(ValueError, match="moved when only a padded row changed"):
        fit(NamesTheAxisCountingPaddedRows, rows=90, strategy="dp")
    _, history = fit(NamesTheAxisCountingPaddedRows, rows=96, strategy="dp")  # no padded row: nothing to refuse
    assert len(history["loss"]) == 1 and np.isfinite(history["loss"][0])


def test_a_value_the_step_reads_changed_by_a_callback_mid_fit_stops_it_naming_the_fix():
    trainer = Weighted(TwoParts(), optimizer=groups(), strategy="single")
    anneal = tk.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: setattr(trainer, "beta", 0.5))
    with pytest.raises(RuntimeError, match=r"reads self.beta, which changed during this fit \(beta: 1.0 -> 0.5"):
        trainer.fit(X, batch_size=32, epochs=3, verbose=0, callbacks=[anneal])
    assert trainer.global_step == 3  # one epoch trained, its state kept
    bookkeeping = tk.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: setattr(trainer, "seen", epoch))
    trainer.fit(X, batch_size=32, epochs=2, verbose=0, callbacks=[bookkeeping])  # a value the step never reads
    assert trainer.seen == 1 and trainer.history.history["beta"] == [0.5, 0.5]


@pytest.mark.parametrize(
    "value", [np.float32(0.5), jnp.float32(0.5), np.array(0.5)], ids=["np.float32", "jnp.float32", "0-d array"]
)
def test_a_number_of_any_kind_the_step_reads_is_watched_as_a_float_is(value):
    """#82 (CU11): ``self.beta`` changed as a NumPy scalar, a JAX scalar or a 0-d array was silently ignored (only
    a Python number was watched): now a change during fit stops it by name, and one between fits retraces."""
    trainer = Weighted(TwoParts(), optimizer=groups(), strategy="single")
    anneal = tk.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: setattr(trainer, "beta", value))
    with pytest.raises(RuntimeError, match=r"reads self.beta, which changed during this fit \(beta: 1.0 -> 0.5"):
        trainer.fit(X, batch_size=32, epochs=3, verbose=0, callbacks=[anneal])
    trainer.beta = value * 0.5
    with pytest.warns(UserWarning, match=r"beta: 1.0 -> 0.25.*traced again"):  # the traced value, then this one
        assert trainer.fit(X, batch_size=32, verbose=0).history["beta"] == [0.25]


class GeneratorWarmUp(Alternating):
    """The critic trains; the generator gets zero gradients on purpose for now, and says so."""

    def train_step(self, state, batch, rng):
        critic_rows, _ = self.losses(state, batch, rng)
        c_loss, grads = jax.value_and_grad(lambda p: state.mean(critic_rows(p), batch))(state.params)
        state = state.apply_gradients(grads, "critic")
        resting = jax.tree.map(jnp.zeros_like, state.params)
        return state.apply_gradients(resting, "generator", allow_zero_gradients=True), {"c_loss": c_loss}


def test_zero_gradients_meant_for_a_group_are_allowed_when_the_step_says_so():
    """#82 (CU9): a correct step whose group gets zero gradients on purpose (a generator's warm-up) was refused by
    the zero-gradient audit with no way to say it is meant; the refusal now names the way, which trains."""
    with pytest.raises(ValueError, match=r"allow_zero_gradients=True"):
        fit(CriticGradientsToTheGenerator)
    trainer, history = fit(GeneratorWarmUp, epochs=2)
    assert np.isfinite(history["c_loss"]).all() and trainer.global_step == 6


class CriticSteps(Alternating):
    """WGAN-GP's shape: several critic updates, then the generator's; ``loop`` says how the critic's are written."""

    loop = "unrolled"

    def train_step(self, state, batch, rng):
        critic_rows, generator_rows = self.losses(state, batch, rng)

        def critic_update(state):
            grads = jax.grad(lambda p: state.mean(critic_rows(p), batch))(state.params)
            return state.apply_gradients(grads, "critic")

        if self.loop == "unrolled":
            for _ in range(2):
                state = critic_update(state)
        elif self.loop == "fori_loop":
            state = jax.lax.fori_loop(0, 2, lambda i, s: critic_update(s), state)
        elif self.loop == "scan":
            state = jax.lax.scan(lambda s, _: (critic_update(s), None), state, length=2)[0]
        else:  # cond: the second update under a condition that holds
            state = jax.lax.cond(state.step >= 0, critic_update, lambda s: s, critic_update(state))
        g_loss, grads = jax.value_and_grad(lambda p: state.mean(generator_rows(p), batch))(state.params)
        return state.apply_gradients(grads, "generator"), {"g_loss": g_loss}


@pytest.mark.parametrize("strategy", ["single", "dp"])
@pytest.mark.parametrize("loop", ["fori_loop", "scan", "cond"])
def test_updates_inside_a_loop_or_a_condition_train_as_the_unrolled_step(loop, strategy):
    """#82 (CU4): ``state.apply_gradients`` inside ``lax.fori_loop`` / ``scan`` / ``cond`` (the critic's steps written
    the JAX way) was a raw UnexpectedTracerError from trainkit's own first-batch audit; now it trains, equal to the
    same updates unrolled, and the audit still sees each pass's gradients."""
    unrolled, _ = fit(CriticSteps, strategy=strategy)
    looped, _ = fit(type("Looped", (CriticSteps,), {"loop": loop}), strategy=strategy)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), looped.params, unrolled.params)


class WrongGroupInALoop(Alternating):
    def train_step(self, state, batch, rng):
        critic_rows, _ = self.losses(state, batch, rng)

        def update(i, state):
            grads = jax.grad(lambda p: state.mean(critic_rows(p), batch))(state.params)
            return state.apply_gradients(grads, "generator")  # the critic's loss: zero for the generator

        return jax.lax.fori_loop(0, 2, update, state), {}


def test_the_audit_sees_an_update_inside_a_loop():
    with pytest.raises(ValueError, match=r"updates 'generator' on gradients that are all zero"):
        fit(WrongGroupInALoop)
