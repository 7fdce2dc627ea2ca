"""``steps_per_execution=k``: k steps fused in one compiled call (a ``lax.scan``) equal k single
steps under every strategy, compile at most one extra shape, run the batch hooks once per
execution as Keras 3 does, and stop, validate and resume where single steps would."""

import re

import jax
import numpy as np
import optax
import pytest
from conftest import MLP, NoisyMLP, make_classification, strategy_table
from test_compile import compiles  # noqa: F401 - the compile-counting fixture

import trainkit as tk
from trainkit.callbacks import Callback

N, BATCH, K = 330, 32, 4  # 11 batches per epoch: two fused executions and a last span of 3 single steps

STRATEGIES = strategy_table(min_shard_size=16)


@pytest.fixture(scope="module")
def xy():
    return make_classification(N)


def make(strategy="single", k=1, model=None, **kwargs):
    return tk.Trainer(
        model or NoisyMLP(dense_bias=False),  # the fused steps compared, not the rounding Adam scales up
        loss="sparse_categorical_crossentropy",
        optimizer=optax.adam(1e-2),
        metrics=["accuracy"],
        strategy=strategy,
        steps_per_execution=k,
        **kwargs,
    )


def assert_same_run(a, b, history_a, history_b, atol=2e-6):
    for left, right in zip(jax.tree.leaves(a.state), jax.tree.leaves(b.state), strict=True):
        np.testing.assert_allclose(np.asarray(left), np.asarray(right), rtol=1e-5, atol=atol)
    assert history_a.history.keys() == history_b.history.keys()
    for key, values in history_a.history.items():
        np.testing.assert_allclose(values, history_b.history[key], rtol=1e-5, atol=atol, err_msg=key)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_k_fused_steps_equal_k_single_steps_under_every_strategy(xy, name):
    """BatchNorm and Dropout included (the rng is folded per step), ragged last batch included."""
    x, y = xy
    runs = []
    for k in (1, K):
        trainer = make(STRATEGIES[name](), k)
        history = trainer.fit((x, y), batch_size=BATCH, epochs=2, validation_data=(x[:64], y[:64]), verbose=0)
        runs.append((trainer, history))
    (single, single_history), (fused, fused_history) = runs
    assert int(fused.state.step) == int(single.state.step) == 22
    assert_same_run(single, fused, single_history, fused_history)


def test_a_fused_run_compiles_two_train_shapes_once_and_nothing_in_later_epochs(xy, compiles):  # noqa: F811
    x, y = xy
    at_epoch = []
    mark = tk.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs=None: at_epoch.append(len(compiles)))
    trainer = make("single", K, model=MLP())
    trainer.fit((x, y), batch_size=BATCH, epochs=3, validation_data=(x[:64], y[:64]), callbacks=[mark], verbose=0)
    assert at_epoch[1] == at_epoch[2] == len(compiles), compiles  # none after the first epoch
    names = [name for name in compiles if "step" in (name or "")]  # each once: k steps, one step (the last
    # 3 batches of every epoch) and the evaluation
    assert sorted(names) == ["jit(eval_step)", "jit(multi_step)", "jit(train_step)"], compiles


class Spans(Callback):
    """The loop's record at every batch-end hook: which steps and batches an execution covered."""

    def __init__(self):
        super().__init__()
        self.records = []

    def on_train_batch_end(self, batch, logs=None):
        record = self.session.record
        self.records.append((batch, record.first_batch, record.first_step, record.step))


def test_the_record_says_which_steps_each_execution_covered(xy):
    x, y = xy
    spans = Spans()
    make("single", K, model=MLP()).fit((x, y), batch_size=BATCH, epochs=2, verbose=0, callbacks=[spans])
    first_epoch = [(3, 0, 1, 4), (7, 4, 5, 8), (10, 8, 9, 11)]
    assert spans.records == first_epoch + [(b, f, s + 11, e + 11) for b, f, s, e in first_epoch]


def test_max_steps_and_validation_interval_cut_executions_where_single_steps_stop(xy):
    x, y = xy
    runs = []
    for k in (1, K):
        trainer = make("single", k, model=MLP())
        history = trainer.fit(
            (x, y),
            batch_size=BATCH,
            epochs=2,
            max_steps=15,
            validation_data=(x[:64], y[:64]),
            validation_interval=6,
            verbose=0,
        )
        runs.append((trainer, history))
    (single, single_history), (fused, fused_history) = runs
    assert int(fused.state.step) == 15
    assert [v["step"] for v in fused_history.validations] == [v["step"] for v in single_history.validations] == [6, 12]
    for left, right in zip(single_history.validations, fused_history.validations, strict=True):
        assert left.keys() == right.keys()
        np.testing.assert_allclose([left[k] for k in left], [right[k] for k in left], rtol=1e-5, atol=2e-6)
    assert_same_run(single, fused, single_history, fused_history)


class PreemptAt(Callback):
    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if self.trainer.global_step >= self.step:
            self.session.preempt()


def test_a_fused_run_preempted_mid_epoch_resumes_with_single_steps_to_the_same_result(xy, tmp_path):
    x, y = xy
    fit = {"batch_size": BATCH, "epochs": 2, "verbose": 0, "shuffle": True}
    reference = make("single", 1, model=MLP())
    reference.fit((x, y), **fit)
    backup = tk.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=5)
    with pytest.raises(tk.Preempted) as raised:
        make("single", K, model=MLP()).fit((x, y), callbacks=[backup, PreemptAt(16)], **fit)
    assert raised.value.step == 19  # the execution of steps 16-19 ends in epoch 1 at batch 7
    resumed = make("dp", 1, model=MLP())
    resumed.fit((x, y), callbacks=[tk.callbacks.BackupAndRestore(tmp_path / "backup")], **fit)
    assert int(resumed.state.step) == 22
    for left, right in zip(jax.tree.leaves(reference.state), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_allclose(np.asarray(left), np.asarray(right), rtol=1e-5, atol=2e-6)


def test_periodic_saves_fire_at_the_execution_that_reaches_their_step(xy, tmp_path):
    x, y = xy
    saved = []

    class Spy(tk.callbacks.BackupAndRestore):
        def _save(self, wait=False):
            saved.append(self.trainer.global_step)
            super()._save(wait)

    backup = Spy(tmp_path / "backup", save_freq=5, delete_checkpoint=False)
    make("single", K, model=MLP()).fit((x, y), batch_size=BATCH, epochs=2, verbose=0, callbacks=[backup])
    # executions begin after steps 0, 4, 8, 11 (3 single steps follow), 15, 19: a save is due at the first
    # one at or after a multiple of 5 (step 20 is passed by the last execution, after which no batch begins)
    assert saved == [8, 11, 15]


def test_bad_steps_per_execution_and_a_strategy_that_cannot_fuse_are_refused_at_construction():
    for bad in (0, -2, 1.5, True, "4"):
        with pytest.raises(ValueError, match="steps_per_execution must be a positive integer"):
            make("single", bad)

    class OwnStrategy(tk.Strategy):
        pass

    with pytest.raises(TypeError, match="OwnStrategy does not implement put_batches and compile_train_steps"):
        make(OwnStrategy(), 4)


def test_run_eagerly_runs_the_k_steps_one_by_one_to_the_same_result(xy):
    x, y = xy
    compiled, eager = make("single", K, model=MLP()), make("single", K, model=MLP(), run_eagerly=True)
    histories = [t.fit((x[:160], y[:160]), batch_size=BATCH, epochs=1, verbose=0) for t in (compiled, eager)]
    assert_same_run(compiled, eager, *histories, atol=1e-5)


def test_hooks_indices_logs_and_weights_match_keras_steps_per_execution():
    """Keras 3 (JAX backend) compiled with ``steps_per_execution=2`` against trainkit with the same:
    every hook (fit, validation, evaluate, predict) with Keras's begin / end indices, and the
    same losses and weights (a linear regression, 3 batches per epoch, the last one ragged)."""
    keras = pytest.importorskip("keras")
    import flax.linen as nn
    from test_keras_semantics import BATCH as KERAS_BATCH
    from test_keras_semantics import N as KERAS_N
    from test_keras_semantics import Recorder, flat, keras_model, twins

    rng = np.random.default_rng(0)
    x = rng.normal(size=(KERAS_N, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], "float32") + 0.1).astype("float32")
    model = keras_model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=2)
    kernel, bias = model.get_weights()
    trainer = tk.Trainer(
        nn.Dense(1),
        loss="mse",
        optimizer=optax.sgd(0.05),
        strategy="single",
        params={"kernel": kernel, "bias": bias},
        steps_per_execution=2,
    )
    recorders = dict(zip(("keras", "tk"), twins(Recorder)))
    fit = {"epochs": 2, "batch_size": KERAS_BATCH, "shuffle": False, "verbose": 0, "validation_data": (x, y)}
    keras_history = model.fit(x, y, callbacks=[recorders["keras"]], **fit)
    tk_history = trainer.fit((x, y), callbacks=[recorders["tk"]], **fit)
    model.evaluate(x, y, batch_size=KERAS_BATCH, callbacks=[recorders["keras"]], verbose=0)
    trainer.evaluate((x, y), batch_size=KERAS_BATCH, callbacks=[recorders["tk"]])
    keras_predictions = model.predict(x, batch_size=KERAS_BATCH, callbacks=[recorders["keras"]], verbose=0)
    tk_predictions = trainer.predict(x, batch_size=KERAS_BATCH, callbacks=[recorders["tk"]])
    # The one deliberate difference: Keras 3 ends an epoch's shorter last execution at index
    # begin + k - 1 (3 here, a batch that does not exist); trainkit names the last batch trained.
    last = -(-KERAS_N // KERAS_BATCH) - 1
    keras_events = [
        (name, min(index, last) if name.endswith("batch_end") else index, logs)
        for name, index, logs in recorders["keras"].events
    ]
    assert ("train_batch_end", last + 1, ("loss",)) in recorders["keras"].events
    assert recorders["tk"].events == keras_events
    batch_ends = [index for name, index, _ in recorders["tk"].events if name == "train_batch_end"]
    assert batch_ends == [1, 2, 1, 2]  # two executions per epoch: batches 0-1, then batch 2
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(tk_history.history[key], keras_history.history[key], rtol=1e-5)
    for left, right in zip(flat(trainer.get_weights()), flat(model.get_weights()), strict=True):
        np.testing.assert_allclose(left, right.reshape(left.shape), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tk_predictions, keras_predictions, rtol=1e-5, atol=1e-6)


class AsyncSpans(Spans):
    async_safe = True  # a batch hook that puts no cap on the steps per call


def test_auto_times_the_first_steps_then_fuses_what_it_picked_to_the_same_result(xy, monkeypatch):
    """``steps_per_execution="auto"``: PROBES timed single steps, then the tuner's pick (forced
    to K here; timings are the benchmark's business) for the rest of the run and later fits."""
    from trainkit.loop import tuning

    picked = []
    monkeypatch.setattr(tuning.StepsTuner, "decide", lambda self, host, device: picked.append((host, device)) or K)
    x, y = xy
    auto, single = make("single", "auto"), make("single", 1)
    spans = AsyncSpans()
    auto_history = auto.fit((x, y), batch_size=BATCH, epochs=2, callbacks=[spans], verbose=0)
    single_history = single.fit((x, y), batch_size=BATCH, epochs=2, verbose=0)
    assert len(picked) == 1 and all(host > 0 and device > 0 for host, device in picked)
    assert auto.steps_per_execution == K
    sizes = [last - first + 1 for _, _, first, last in spans.records]  # steps per call
    assert sizes[: tuning.PROBES + 1] == [1] * (tuning.PROBES + 1) and sizes.count(K) >= 3, sizes  # timed, then fused
    assert_same_run(single, auto, single_history, auto_history)


def test_auto_keeps_one_step_per_call_for_a_callback_that_needs_every_batch(xy):
    x, y = xy
    auto = make("single", "auto")
    auto.fit((x, y), batch_size=BATCH, epochs=1, callbacks=[tk.callbacks.TerminateOnNaN()], verbose=0)
    assert auto.steps_per_execution == 1
    with pytest.raises(ValueError, match="steps_per_execution must be a positive integer"):
        make("single", "fast")


def test_auto_s_pick_is_reported_in_the_plan(xy, monkeypatch):
    from trainkit.loop import tuning

    monkeypatch.setattr(tuning.StepsTuner, "decide", lambda self, host, device: K)
    x, y = xy
    trainer = make("auto", "auto")
    trainer.fit((x, y), batch_size=BATCH, epochs=2, verbose=0)
    assert trainer.last_plan is not None and trainer.steps_per_execution == K
    assert f"steps_per_execution='auto': picked {K}: " in str(trainer.last_plan)
    assert re.search(
        r"picked \d+: \d+ us of host time per call, \d+ us of device time per step", str(trainer.last_plan)
    )


def test_the_default_fuses_what_the_tuner_picks_to_the_same_result(xy, monkeypatch):
    """Left to its default, ``steps_per_execution`` tunes as ``"auto"`` does (with the repay
    rule on) when no callback needs a call per batch, and trains to the bits of k=1."""
    from trainkit.loop import tuning

    asked = []
    monkeypatch.setattr(tuning.StepsTuner, "decide", lambda self, host, device: asked.append(self.repaid_only) or K)
    x, y = xy
    default, single = make("single", None), make("single", 1)
    spans = AsyncSpans()
    history = default.fit((x, y), batch_size=BATCH, epochs=2, callbacks=[spans], verbose=0)
    assert asked == [True] and default.steps_per_execution == K
    assert [last - first + 1 for _, _, first, last in spans.records].count(K) >= 3
    assert_same_run(single, default, single.fit((x, y), batch_size=BATCH, epochs=2, verbose=0), history)


def test_the_default_goes_back_to_one_step_where_fused_calls_measure_slower(xy, monkeypatch):
    """The default checks its pick on the first fused calls: where they measure slower a step than
    one step per call, the fit trains one step per call from then on (and later fits stay there),
    to the bits of k=1; the fused compile's measured cost is kept for later decisions."""
    from trainkit.loop import tuning

    monkeypatch.setattr(tuning.StepsTuner, "decide", lambda self, host, device: K)
    monkeypatch.setattr(tuning.FusedCheck, "per_step", lambda self: 1.0)  # a fused step "measured" at 1 s
    x, y = xy
    default, single = make("single", None), make("single", 1)
    spans = AsyncSpans()
    history = default.fit((x, y), batch_size=BATCH, epochs=3, callbacks=[spans], verbose=0)
    sizes = [last - first + 1 for _, _, first, last in spans.records]
    assert sizes.count(K) == 1 + tuning.CHECKS and sizes[-7:] == [1] * 7  # compile, checks, then one a call
    assert default.steps_per_execution == 1 and not default.setup.decided.tunes_steps
    assert default.loop.timings.compile_factor is not None and default.loop.timings.compile_factor > 0
    assert_same_run(single, default, single.fit((x, y), batch_size=BATCH, epochs=3, verbose=0), history)


def test_the_default_keeps_one_step_where_the_fit_would_not_repay_the_compile(xy, monkeypatch):
    """A k the rest of the fit does not repay (the host time saved below the compile's
    estimate) leaves the fit at one step per call, undecided: the next fit decides again, from
    the timings the first one took."""
    from trainkit.loop import tuning

    remaining = []

    def decide(self, host, device):
        remaining.append(self.remaining)
        self.compile_seconds = 10.0  # a slow compile: 20 s to repay
        return K if self.repays(K, host=1e-3) else 1  # 1 ms a call saves under 0.3 s in this fit

    monkeypatch.setattr(tuning.StepsTuner, "decide", decide)
    x, y = xy
    trainer = make("single", None)
    spans = AsyncSpans()
    trainer.fit((x, y), batch_size=BATCH, epochs=2, callbacks=[spans], verbose=0)
    assert trainer.steps_per_execution == 1 and trainer.setup.decided.tunes_steps
    assert {last - first for _, _, first, last in spans.records} == {0}
    assert remaining == [2 * 11]  # decided once in the fit: 2 epochs of 11 batches
    timed = []
    monkeypatch.setattr(tuning.StepsTuner, "record", lambda self, host, device: timed.append(host))
    trainer.fit((x, y), batch_size=BATCH, epochs=1, verbose=0)
    assert remaining == [22, 11] and timed == []  # decided again from the first fit's timings: no step timed


def test_the_default_weighs_a_fused_compile_by_the_one_step_compile_wherever_it_ran(xy, monkeypatch):
    """Where the memory check compiled the train step before its first call (an accelerator; here a
    CPU given a device memory), the tuner's unit is that first call plus the compile it did not
    pay, and the fused compile's prior is the platform's (:data:`~trainkit.loop.tuning.FUSED_COMPILE_FACTORS`)."""
    from trainkit.loop import tuning
    from trainkit.planning.plan import MEMORY_VARIABLE

    seen = []
    monkeypatch.setenv(MEMORY_VARIABLE, str(2**30))
    monkeypatch.setitem(tuning.FUSED_COMPILE_FACTORS, "cpu", 123.0)
    monkeypatch.setattr(tuning.StepsTuner, "decide", lambda self, host, device: seen.append(self) or 1)
    x, y = xy
    trainer = make("single", None)
    trainer.fit((x, y), batch_size=BATCH, epochs=1, verbose=0)
    ahead = trainer.compiled.compiled_ahead_seconds("train")
    assert ahead > 0 and make("single", None).compiled.compiled_ahead_seconds("train") == 0.0
    (tuner,) = seen
    assert tuner.compile_factor == 123.0 and tuner.compile_seconds == trainer.loop.timings.first_call > ahead


def test_the_default_calls_a_keras_batch_callback_every_batch_and_deterministic_never_tunes(xy):
    x, y = xy

    class EveryBatch(Callback):  # not async_safe: it expects the state after each batch, as in Keras
        def __init__(self):
            self.batches = []

        def on_train_batch_end(self, batch, logs=None):
            self.batches.append(batch)

    every = EveryBatch()
    trainer = make("single", None)
    trainer.fit((x, y), batch_size=BATCH, epochs=1, callbacks=[every], verbose=0)
    assert every.batches == list(range(11)) and trainer.steps_per_execution == 1
    deterministic = make("single", None, deterministic=True)
    assert not deterministic.setup.decided.tunes_steps and deterministic.steps_per_execution == 1


def test_a_fused_call_carries_its_totals_packed_or_unpacked_to_the_same_bits():
    """On a TPU a fused call unpacks the loop's packed totals once for its k steps (``TOTALS_UNPACKED_ON``),
    elsewhere it keeps them packed at every step (faster on a CPU): the same state and totals, bit for bit,
    and the unpacked scan's body holds no concatenate of the packed bits."""
    import jax.numpy as jnp

    from trainkit.core.state import TrainState
    from trainkit.core.step import TOTALS_UNPACKED_ON, batches_at, make_multi_step, make_train_step, with_totals
    from trainkit.core.totals import EpochTotals, pack

    def compute_loss(params, batch, rng, *, model_state, train):
        return (batch["x"] @ params - batch["y"]) ** 2, (None, model_state)

    tx = optax.adam(0.1)
    params = jnp.ones((3,))
    state = TrainState.create(params=params, opt_state=tx.init(params), model_state={}, seed=0)
    rng = np.random.default_rng(0)
    batches = {"x": rng.normal(size=(5, 4, 3)), "y": rng.normal(size=(5, 4)), "mask": np.ones((5, 4))}
    batches = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), batches)
    step = with_totals(make_train_step(compute_loss, tx, {}))
    totals = pack(
        EpochTotals.empty(jax.eval_shape(make_train_step(compute_loss, tx, {}), state, batches_at(batches, 0))[1])
    )
    results = {}
    for unpack in (False, True):
        fused = make_multi_step(step, unpack_totals=unpack)
        results[unpack] = jax.jit(fused)(state, totals, batches)
        scan = next(e for e in jax.make_jaxpr(fused)(state, totals, batches).jaxpr.eqns if e.primitive.name == "scan")
        inside = {e.primitive.name for e in scan.params["jaxpr"].jaxpr.eqns}
        assert ("concatenate" in inside) is not unpack, (unpack, inside)
    (a_state, a_totals), (b_state, b_totals) = results[False], results[True]
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a_state), jax.tree.leaves(b_state), strict=True))
    assert all(np.array_equal(x, y) for x, y in zip(a_totals.arrays, b_totals.arrays, strict=True))
    assert int(b_totals.unpack().steps) == 5 and TOTALS_UNPACKED_ON == {"tpu"}


def test_an_epoch_s_first_step_merges_averages_without_a_select_per_metric():
    """Zeros of a ``WeightedAverage`` (and a ``LabelAlarm``) merge as an identity, so merging a step into the
    totals selects nothing per such metric (on a TPU each select is work at every step of a fused call);
    a ``LastValue`` still takes its first step's value, and the first step's values are kept exactly."""
    import clu.metrics
    import jax.numpy as jnp

    from trainkit.core.totals import EpochTotals, LabelAlarm, LossAverage, WeightedAverage

    def step_metrics(names):
        metrics = {name: WeightedAverage(total=jnp.float32(-0.5), count=jnp.float32(2)) for name in names}
        return {
            **metrics,
            "loss": LossAverage(total=jnp.float32(3.0), count=jnp.float32(2)),
            "_alarm": LabelAlarm.none(),
        }

    def selects(names):
        metrics = step_metrics(names)
        jaxpr = jax.make_jaxpr(lambda m: EpochTotals.empty(m).add(m))(metrics)
        return sum(e.primitive.name == "select_n" for e in jaxpr.jaxpr.eqns)

    assert selects(["a", "b", "c", "d"]) == selects([])
    last = {
        "loss": LossAverage(total=jnp.float32(1.0), count=jnp.float32(1)),
        "lr": clu.metrics.LastValue.from_model_output(jnp.float32(7.0)),
    }
    merged = EpochTotals.empty(last).add(last).metrics
    assert float(merged["lr"].compute()) == 7.0
    first = EpochTotals.empty(step_metrics(["a"])).add(step_metrics(["a"])).metrics
    assert float(first["a"].total) == -0.5 and float(first["loss"].total) == 3.0 and int(first["_alarm"].count) == 0
