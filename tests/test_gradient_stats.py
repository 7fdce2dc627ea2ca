"""GradientStats: norms computed inside the compiled step, equal to a hand computation and the
same under every strategy and with fused steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import NoisyMLP, Wide, make_classification, strategy_table

import trainkit as tk

X, Y = make_classification(192, features=64)
Y = Y % 8
STRATEGIES = strategy_table(min_shard_size=64)


class Recorder(tk.callbacks.Callback):
    """Every batch log that carries the statistics (it comes after GradientStats)."""

    async_safe = True

    def __init__(self):
        self.logged = {}

    def reads_batch_logs(self):
        return True

    def on_train_batch_end(self, batch, logs=None):
        if "grad_norm" in logs:
            step = self.session.require_record().step
            self.logged[step] = {k: v for k, v in logs.items() if "norm" in k or "ratio" in k}


def measured(strategy, steps_per_execution=1, model=None):
    trainer = tk.Trainer(
        model or Wide(),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.adam(1e-3),
        strategy=STRATEGIES[strategy](),
        steps_per_execution=steps_per_execution,
    )
    stats, recorder = tk.callbacks.GradientStats(every=3, per_layer="Dense"), Recorder()
    history = trainer.fit(X, Y, batch_size=32, epochs=2, verbose=0, shuffle=False, callbacks=[stats, recorder])
    return stats, recorder, history


@pytest.fixture(scope="module")
def reference():
    return measured("single")


def test_the_norms_equal_a_hand_computation_on_one_device():
    model = Wide()
    trainer = tk.Trainer(model, loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.5), strategy="single")
    trainer.init(X[:32])
    params = jax.tree.map(np.asarray, trainer.params)
    stats = tk.callbacks.GradientStats(every=1, per_layer="Dense_1")
    trainer.fit(X[:32], Y[:32], batch_size=32, epochs=1, verbose=0, callbacks=[stats])

    def loss(p):
        logits = model.apply({"params": p}, X[:32])
        return optax.softmax_cross_entropy_with_integer_labels(logits, Y[:32]).mean()

    grads = jax.grad(loss)(params)
    layer = lambda tree: jnp.sqrt(sum(jnp.sum(jnp.square(a)) for a in jax.tree.leaves(tree["Dense_1"])))  # noqa: E731
    norm = lambda tree: jnp.sqrt(sum(jnp.sum(jnp.square(a)) for a in jax.tree.leaves(tree)))  # noqa: E731
    updates = jax.tree.map(lambda g: -0.5 * g, grads)
    expected = {
        "grad_norm": norm(grads),
        "param_norm": norm(params),
        "update_norm": norm(updates),
        "update_ratio": norm(updates) / norm(params),
        "grad_norm/Dense_1": layer(grads),
        "param_norm/Dense_1": layer(params),
        "update_norm/Dense_1": layer(updates),
        "update_ratio/Dense_1": layer(updates) / layer(params),
    }
    assert stats.steps == [1]
    assert set(stats.values) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(stats.values[name], float(value), rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("strategy", ["dp8", "fsdp8", "hybrid2x4_fsdp"])
def test_every_strategy_measures_what_one_device_measures(reference, strategy):
    stats, recorder, history = measured(strategy)
    ref_stats, ref_recorder, ref_history = reference
    assert stats.steps == ref_stats.steps == [3, 6, 9, 12]  # 6 steps an epoch, every 3rd
    assert recorder.logged.keys() == ref_recorder.logged.keys() == {3, 6, 9, 12}
    assert len(ref_recorder.logged[3]) == 4 * 4  # 4 kinds, global and for Dense_0..2
    for step, values in ref_recorder.logged.items():
        for name, value in values.items():
            np.testing.assert_allclose(recorder.logged[step][name], value, rtol=1e-6, atol=1e-6, err_msg=(step, name))
    np.testing.assert_allclose(history.history["grad_norm/Dense_2"], ref_history.history["grad_norm/Dense_2"], 1e-5)


@pytest.mark.parametrize("strategy", ["hybrid2x4_fsdp"])
def test_a_fused_call_keeps_the_statistics_of_the_step_that_was_due(reference, strategy):
    stats, recorder, _ = measured(strategy, steps_per_execution=2)
    ref_stats, ref_recorder, _ = reference
    # 6 steps an epoch in calls of 2: steps 3 and 9 inside calls (3-4, 9-10), 6 and 12 at their ends
    assert stats.steps == [3, 6, 9, 12], stats.steps
    for step in stats.steps:  # logged at the end of the call that held the step
        logged = recorder.logged[min(s for s in recorder.logged if s >= step)]
        for name, value in ref_recorder.logged[step].items():
            np.testing.assert_allclose(logged[name], value, rtol=1e-6, atol=1e-6, err_msg=(step, name))


def test_a_due_step_in_the_single_steps_after_fused_calls_measures_without_touching_a_donated_state(reference):
    """#59: calls of 4 steps, then an epoch's last 2 batches one call each, step 6 due in them:
    the measuring step, looked up there, read the state the call of step 5 had donated
    ("Array has been deleted"). It is the reference's measurement, and the parameters are
    those of a fit without statistics, bit for bit."""
    _, ref_recorder, _ = reference

    def fit(callbacks):
        trainer = tk.Trainer(Wide(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3),
                             strategy="single", steps_per_execution=4)  # fmt: skip
        trainer.fit(X, Y, batch_size=32, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
        return trainer

    stats, recorder = tk.callbacks.GradientStats(every=6, per_layer="Dense"), Recorder()
    measuring, plain = fit([stats, recorder]), fit([])
    assert stats.steps == [6, 12], stats.steps
    for step in stats.steps:
        for name, value in ref_recorder.logged[step].items():
            np.testing.assert_allclose(recorder.logged[step][name], value, rtol=1e-6, atol=1e-6, err_msg=(step, name))
    for ours, theirs in zip(jax.tree.leaves(measuring.params), jax.tree.leaves(plain.params), strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_a_short_fit_compiles_one_train_program_whatever_every_is():
    """#59: every=100 cost a short first fit more than every=1 (its step that measures nothing
    was a second compile). The measuring step trains every step until the steps have run as long
    as its compile took (loop/measuring.py): a fit shorter than that compiles as every=1 does."""
    from jax._src import dispatch

    def compiled_train_programs(every):
        seen = []

        def listener(event, duration=None, **kwargs):
            if event == dispatch.BACKEND_COMPILE_EVENT:
                seen.append(kwargs.get("fun_name"))

        trainer = tk.Trainer(Wide(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3),
                             strategy="single", steps_per_execution=1)  # fmt: skip
        trainer.init(X[:32])
        stats = tk.callbacks.GradientStats(every=every)
        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            trainer.fit(X, Y, batch_size=32, epochs=2, verbose=0, shuffle=False, callbacks=[stats])
            first = list(seen)
            trainer.fit(X, Y, batch_size=32, epochs=1, verbose=0, shuffle=False, callbacks=[stats])
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
        return first, seen[len(first) :], stats.steps

    every_step, _, steps_1 = compiled_train_programs(1)
    every_5, second_fit, steps_5 = compiled_train_programs(5)
    assert steps_1 == list(range(13, 19)) and steps_5 == [15], (steps_1, steps_5)  # steps: the last fit's
    assert len(every_5) == len(every_step), (every_5, every_step)
    assert second_fit == [], second_fit  # the steps' time is counted over the fits, not the time between


def test_the_steps_of_a_profiled_fit_count_toward_compiling_the_step_that_measures_nothing():
    """Steps marked for a profile (``annotate_steps``) run through their own branch of the loop:
    their seconds count toward the rule as the plain steps' do (once, they counted none, and
    such a fit measured between the due steps forever)."""
    trainer = tk.Trainer(Wide(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3),
                         strategy="single", steps_per_execution=1)  # fmt: skip
    trainer.loop.annotate_steps = True
    trainer.fit(X, Y, batch_size=32, epochs=2, verbose=0, callbacks=[tk.callbacks.GradientStats(every=5)])
    (plan,) = trainer.loop.measuring.values()
    assert plan.compile_seconds is not None and plan.spent > 0, (plan.compile_seconds, plan.spent)


def test_nothing_is_measured_or_logged_without_the_callback():
    trainer = tk.Trainer(NoisyMLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1))
    x, y = make_classification(64)
    history = trainer.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert not [name for name in history.history if "norm" in name]
    assert trainer.setup.compiled.statistics is None


def test_a_fused_call_longer_than_every_is_refused_naming_both():
    """A call of 4 steps with every=3 could hold steps 9 and 12 and keep only 12: refused before
    the first step, naming the settings that work."""
    with pytest.raises(ValueError, match=r"GradientStats\(every=3\) with steps_per_execution=4: .*Pass every >= 4"):
        measured("single", steps_per_execution=4)


def test_bad_arguments_are_refused_before_training():
    with pytest.raises(ValueError, match="every must be a positive number of steps"):
        tk.callbacks.GradientStats(every=0)
    with pytest.raises(ValueError, match="is not a regular expression"):
        tk.callbacks.GradientStats(per_layer="(")


def test_between_due_steps_the_plain_step_carries_no_statistics_and_the_due_ones_see_the_last(reference, monkeypatch):
    """#59: the plain step between due steps passed the statistics' array through, and XLA copied
    it every step (+3% on a dispatch-bound step). Once the measuring step stops training every step,
    the plain one takes the totals without it (loop/measuring.py: SetAside); every measurement and
    the parameters are unchanged (the reference's; a fit without statistics' bit for bit)."""
    from trainkit.core import leaf_step
    from trainkit.loop import measuring

    monkeypatch.setattr(measuring.BetweenDue, "measures_between", lambda self: self.every == 1)  # rented: no
    arrays_taken, call = [], leaf_step.LeafStep.call_carried

    def counted(self, carried, totals, batch):
        arrays_taken.append(len(totals.arrays))
        return call(self, carried, totals, batch)

    monkeypatch.setattr(leaf_step.LeafStep, "call_carried", counted)
    stats, recorder = tk.callbacks.GradientStats(every=3, per_layer="Dense"), Recorder()
    trainer = tk.Trainer(Wide(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3),
                         strategy="single", steps_per_execution=1)  # fmt: skip
    trainer.fit(X, Y, batch_size=32, epochs=2, verbose=0, shuffle=False, callbacks=[stats, recorder])
    assert arrays_taken == [2 if step % 3 == 0 else 1 for step in range(1, 13)], arrays_taken
    _, ref_recorder, ref_history = reference
    assert stats.steps == [3, 6, 9, 12], stats.steps
    for step in stats.steps:
        for name, value in ref_recorder.logged[step].items():
            np.testing.assert_allclose(recorder.logged[step][name], value, rtol=1e-6, atol=1e-6, err_msg=(step, name))
    plain = tk.Trainer(Wide(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3), strategy="single")
    plain.fit(X, Y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    for ours, theirs in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(plain.params), strict=True):
        np.testing.assert_array_equal(ours, theirs)
