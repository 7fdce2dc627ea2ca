"""find_batch_size (from the compiled plan, never an OOM), find_learning_rate (Lightning's range
test; the state restored bit for bit) and deterministic=True (two fresh processes, identical
parameters)."""

import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from conftest import CHILD_XLA_FLAGS, NoisyMLP, Wide, classifier, make_classification

import trainkit as tk
from trainkit.distributed import determinism
from trainkit.planning.batch_size import candidate_sizes

ROOT = pathlib.Path(__file__).parent.parent
LIMITS = (2**20, 2**22, 2**24)


def clean_env(**extra):
    """This environment for a child process: no compilation cache, the tests' compiler flags."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    return env | {"TRAINKIT_COMPILATION_CACHE": "off", "XLA_FLAGS": CHILD_XLA_FLAGS} | extra


@pytest.fixture(scope="module")
def wide_data():
    """As many rows as the largest size searched: find_batch_size answers no more than the data."""
    rng = np.random.default_rng(0)
    return rng.normal(size=(2**14, 64)).astype(np.float32), rng.integers(0, 8, 2**14)


@pytest.fixture(scope="module")
def searches(wide_data):
    """find_batch_size under FSDP on 8 devices at several memory limits."""
    trainer = tk.Trainer(Wide(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3), strategy="fsdp")
    return trainer, {
        limit: trainer.find_batch_size(*wide_data, memory_limit=limit, max_batch_size=2**14, verbose=0)
        for limit in LIMITS
    }


def test_find_batch_size_grows_with_the_memory_limit(searches):
    _, results = searches
    sizes = [results[limit].batch_size for limit in LIMITS]
    assert sizes == sorted(sizes) and len(set(sizes)) > 2, sizes
    for result in results.values():
        assert result.batch_size % 8 == 0 and math.log2(result.batch_size // 8).is_integer()
        assert result.strategy == "FSDP(fsdp=8)"
        sizes = candidate_sizes(8, 2**14)  # 8, 16, ..., 16384: 12 sizes, bisected in 4 compiles
        assert len(result.plans) <= math.ceil(math.log2(len(sizes) + 1)) == 4


def test_the_answers_plan_fits_and_the_next_sizes_does_not(searches, wide_data):
    trainer, results = searches
    for limit, result in results.items():
        options = {"candidates": [trainer.strategy], "memory_limit": limit, "verbose": 0}
        answer = trainer.plan(wide_data, batch_size=result.batch_size, **options)
        assert answer.recommended is not None, (limit, answer)
        assert answer.recommended.total_bytes == result.needed[result.batch_size]
        if result.batch_size * 2 <= 2**14:
            bigger = trainer.plan(wide_data, batch_size=result.batch_size * 2, **options)
            assert bigger.recommended is None and bigger.rows[0].total_bytes > 0.9 * limit, (limit, bigger)
    assert "within 90% of 1 MiB" in str(results[2**20]) and "(too big)" in str(results[2**20])


def test_find_batch_size_runs_nothing_and_leaves_the_trainer_as_it_was(searches, wide_data):
    trainer, _ = searches
    assert trainer.state is None and trainer.global_step == 0  # compiled only: no state, no step


def test_find_batch_size_under_auto_reports_the_best_strategy(wide_data):
    auto = tk.strategies.Auto(candidates=[tk.SingleDevice(), tk.FSDP()])
    trainer = tk.Trainer(Wide(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3), strategy=auto)
    result = trainer.find_batch_size(*wide_data, memory_limit=2**22, max_batch_size=2**9, verbose=0)
    names = [row.name for row in result.plans[result.batch_size].rows]
    assert result.strategy in names and result.batch_size % 8 == 0
    assert trainer.strategy is None  # a report: "auto" still picks at the first fit


def test_find_batch_size_says_when_nothing_fits(wide_data):
    trainer = tk.Trainer(Wide(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3), strategy="dp")
    with pytest.raises(ValueError, match=r"smallest batch, 8 rows, fits \(nor with remat\): .*remat='full'"):
        trainer.find_batch_size(*wide_data, memory_limit=2**16, verbose=0)
    with pytest.raises(ValueError, match=r"max_batch_size=4 is below 8, the smallest batch the strategy can split"):
        trainer.find_batch_size(*wide_data, max_batch_size=4, verbose=0)


def test_find_batch_size_is_the_same_on_two_processes(searches):
    _, results = searches
    limit = 2**22
    command = [sys.executable, "-m", "trainkit.launch", "--nproc", "2", "--devices-per-proc", "4"]
    command += [str(ROOT / "tests" / "scripts" / "find_batch_size.py"), str(limit)]
    result = subprocess.run(command, capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    answers = [line.split(": ", 1)[1] for line in result.stdout.splitlines() if "batch_size=" in line]
    assert len(answers) == 2 and answers[0] == answers[1], result.stdout
    assert f"batch_size={results[limit].batch_size} " in answers[0]  # as on one process with 8 devices


def test_the_steps_find_batch_size_compiled_are_cached_for_fit(tmp_path):
    """The train step at the answer comes from the persistent compilation cache when fit runs
    it (the state's init and the output check compile; the train step does not)."""
    script = ROOT / "tests" / "scripts" / "find_batch_size.py"
    env = clean_env(JAX_NUM_CPU_DEVICES="8", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env["TRAINKIT_COMPILATION_CACHE"] = str(tmp_path / "cache")
    result = subprocess.run(
        [sys.executable, str(script), str(2**20), "fit"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    hits = re.search(r"fit cache hits (\d+) misses (\d+)", result.stdout)
    assert int(hits.group(1)) >= 1, result.stdout


# ---------------------------------------------------------------------------- find_learning_rate
def _host(trainer):
    return jax.tree.map(np.asarray, tk.distributed.fetch(trainer.state))


def _adam_trainer(strategy="fsdp"):
    return classifier(NoisyMLP(), optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), strategy=strategy)


def test_a_loss_that_is_nan_from_the_first_batch_says_why_there_is_no_suggestion():
    x, y = make_classification(64)
    x[:, 0] = np.nan  # NaN in every input row
    trainer = _adam_trainer("single")
    with pytest.warns(UserWarning, match=r"suggests no rate: the loss was nan at the first batch .*NaN in the inputs"):
        result = trainer.find_learning_rate(x, y, batch_size=32, steps=10)
    assert result.suggestion is None and result.stopped_early


def test_find_learning_rate_leaves_the_state_bit_identical():
    x, y = make_classification(256)
    trainer, untouched = _adam_trainer(), _adam_trainer()
    for t in (trainer, untouched):
        t.fit(x, y, batch_size=32, epochs=1, verbose=0)
    before, step, history = _host(trainer), trainer.global_step, trainer.history
    result = trainer.find_learning_rate(x, y, batch_size=32, steps=40)
    after = _host(trainer)
    assert jax.tree.structure(before) == jax.tree.structure(after)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
    assert trainer.global_step == step and trainer.history is history and trainer.learning_rate == pytest.approx(1e-3)
    assert 1e-7 <= result.suggestion <= 1.0 and result.suggestion in result.lrs
    assert result.suggestions["steep"] == result.suggestion and set(result.suggestions) == {"steep", "min/10", "valley"}
    window = list(zip(result.lrs, result.losses))[10:-1]  # the points every rule reads
    assert result.suggestions["min/10"] == pytest.approx(min(window, key=lambda point: point[1])[0] / 10)
    np.testing.assert_allclose(np.diff(np.log(result.lrs)), np.log(1e7) / 39, rtol=1e-9)  # exponential
    assert len(result.losses) == len(result.raw_losses) == len(result.lrs) and not result.stopped_early
    # the next fit continues as if the search had never run
    for t in (trainer, untouched):
        t.fit(x, y, batch_size=32, epochs=1, verbose=0)
    for a, b in zip(jax.tree.leaves(_host(trainer)), jax.tree.leaves(_host(untouched))):
        np.testing.assert_array_equal(a, b)


def test_find_learning_rate_stops_when_the_loss_diverges_and_plots(tmp_path):
    x, y = make_classification(256)
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    trainer = tk.Trainer(NoisyMLP(), loss="sparse_categorical_crossentropy", optimizer=optimizer, strategy="single")
    result = trainer.find_learning_rate(x, y, batch_size=32, min_lr=1e-3, max_lr=1e4, steps=60)
    assert result.stopped_early and len(result.lrs) < 60
    assert result.suggestion is None or result.suggestion < 1e4
    if __import__("importlib").util.find_spec("matplotlib"):
        result.plot(tmp_path / "lr.png")
        assert (tmp_path / "lr.png").stat().st_size > 5_000
    assert trainer.global_step == 0


def test_find_learning_rate_needs_an_injectable_learning_rate():
    x, y = make_classification(64)
    trainer = tk.Trainer(
        NoisyMLP(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3), strategy="single"
    )
    with pytest.raises(ValueError, match=r"optax.inject_hyperparams"):
        trainer.find_learning_rate(x, y, batch_size=32)
    assert trainer.global_step == 0
    with pytest.raises(ValueError, match="0 < min_lr < max_lr"):
        trainer.find_learning_rate(x, y, batch_size=32, min_lr=1.0, max_lr=0.1)


def injected_trainer():
    """A trainer whose optimizer exposes a settable learning rate (a number)."""
    return classifier(NoisyMLP(), optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=1e-3))


def scheduled_trainer():
    return classifier(
        NoisyMLP(), optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=optax.constant_schedule(1e-3))
    )


def test_a_scheduled_learning_rate_is_refused_wherever_it_would_be_set():
    x, y = make_classification(64)
    finder = scheduled_trainer()
    with pytest.raises(ValueError, match="recomputes it from its step count"):
        finder.find_learning_rate(x, y, batch_size=32, steps=4)
    assert finder.global_step == 0  # refused before any step
    trainer = scheduled_trainer()
    trainer.init((x, y))
    assert trainer.learning_rate == pytest.approx(1e-3)  # read: yes
    with pytest.raises(ValueError, match="pass a number"):
        trainer.learning_rate = 0.5
    for callback in (tk.callbacks.LearningRateScheduler(lambda epoch: 0.5), tk.callbacks.ReduceLROnPlateau("loss")):
        with pytest.raises(ValueError, match="LearningRateScheduler, ReduceLROnPlateau"):
            trainer.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[callback])
        assert trainer.global_step == 0
    fixed = injected_trainer()
    fixed.init((x, y))
    fixed.learning_rate = 0.5  # a number can be set
    assert fixed.learning_rate == 0.5


def test_the_finders_refuse_what_they_cannot_use_and_read_memory_with_units(recwarn):
    x, y = make_classification(64)
    trainer = injected_trainer()
    with pytest.raises(ValueError, match="finite rates"):
        trainer.find_learning_rate(x, y, batch_size=32, max_lr=math.inf)
    with pytest.raises(ValueError, match=r"memory_limit must be a positive number of bytes.*received '4 gigs'"):
        trainer.find_batch_size(x, y, memory_limit="4 gigs", verbose=0)
    assert trainer.find_batch_size(x, y, memory_limit="4GiB", max_batch_size=16, verbose=0).memory_limit == 4 * 2**30
    assert tk.strategies.Auto(memory_limit="512MB").memory_limit == 512 * 10**6
    recwarn.clear()
    diverging = trainer.find_learning_rate(x * np.nan, y, batch_size=32, steps=4)  # NaN from the first step
    assert not [w for w in recwarn if "training goes on" in str(w.message)], [str(w.message) for w in recwarn]
    assert diverging.stopped_early or diverging.suggestion is None


# ---------------------------------------------------------------------------- deterministic=True
def test_two_fresh_deterministic_runs_give_identical_parameters(tmp_path):
    script = ROOT / "tests" / "scripts" / "deterministic_fit.py"
    runs = []
    for i in range(2):
        out = tmp_path / f"run{i}.npz"
        env = clean_env(JAX_NUM_CPU_DEVICES="8")
        result = subprocess.run(
            [sys.executable, str(script), str(out)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
        )
        assert result.returncode == 0, result.stderr[-3000:]
        with np.load(out) as data:
            runs.append({k: data[k] for k in data.files})
    assert "--xla_gpu_deterministic_ops=true" in str(runs[0]["xla_flags"])
    assert str(runs[0]["strategy"]) == str(runs[1]["strategy"])
    weights = [k for k in runs[0] if k.startswith("[")]
    assert len(weights) >= 6
    for key in weights:
        np.testing.assert_array_equal(runs[0][key], runs[1][key], err_msg=key)


def test_deterministic_refuses_a_choice_by_timing_and_a_started_gpu_backend():
    with pytest.raises(ValueError, match="steps_per_execution='auto' picks by timing"):
        tk.Trainer(NoisyMLP(), loss="mse", optimizer=optax.sgd(0.1), deterministic=True, steps_per_execution="auto")
    trainer = tk.Trainer(NoisyMLP(), loss="mse", optimizer=optax.sgd(0.1), deterministic=True)
    assert trainer.setup.auto.measure is False  # "auto" ranks by the compiler's estimate
    missing = determinism.missing_flags("--xla_force_host_platform_device_count=8")
    assert determinism.problem(missing, started=True, platforms={"cpu"}) is None  # XLA:CPU repeats by itself
    message = determinism.problem(missing, started=True, platforms={"gpu"})
    assert "--xla_gpu_deterministic_ops=true" in message and "enable_determinism()" in message
    assert determinism.problem([], started=True, platforms={"gpu"}) is None


def test_find_learning_rate_refuses_a_one_shot_iterator_and_consumes_nothing():
    x, y = make_classification(64)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    generator = (batch for batch in batches)
    trainer = injected_trainer()
    with pytest.raises(ValueError, match="one-shot iterator .generator. for good"):
        trainer.find_learning_rate(generator, batch_size=16, steps=3)
    trainer.fit(generator, steps_per_epoch=4, verbose=0)  # every batch is still there
    assert trainer.global_step == 4
    assert trainer.find_learning_rate(batches, batch_size=16, steps=3).lrs  # a list can be read again
