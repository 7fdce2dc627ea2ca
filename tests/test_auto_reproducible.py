"""``strategy="auto"`` repeats: a simpler strategy is kept unless another is clearly faster,
and the pick is remembered next to the compilation cache, so the next run of the same setup
picks the same at once, also on a busy machine."""

import json
import math
import os
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import MLP, make_classification

import trainkit as tk
from trainkit.distributed import compile_cache
from trainkit.planning import budget as budget_lib
from trainkit.program.setup import Setup

ROOT = pathlib.Path(__file__).parent.parent


@pytest.fixture
def cache_in(tmp_path, monkeypatch):
    """trainkit's compilation cache (and so the remembered picks) in a fresh directory."""
    previous = jax.config.jax_compilation_cache_dir
    monkeypatch.setattr(compile_cache, "_configured", None)
    monkeypatch.setenv(compile_cache.ENVIRONMENT, str(tmp_path))
    jax.config.update("jax_compilation_cache_dir", None)
    yield tmp_path
    jax.config.update("jax_compilation_cache_dir", previous)
    compile_cache._configured = None


def fit_auto(x, y, batch_size=16):
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2))
    trainer.fit((x, y), batch_size=batch_size, epochs=1, verbose=0)
    return trainer


def test_a_remembered_pick_is_taken_without_planning_and_a_new_setup_plans(cache_in, monkeypatch):
    x, y = make_classification(64)
    first = fit_auto(x, y)
    assert first.last_plan is not None
    files = list((cache_in / "trainkit-auto").glob("*.json"))
    assert len(files) == 1 and tk.plan.short_name(first.strategy) in files[0].read_text()

    def no_plan(*args, **kwargs):
        raise AssertionError("planned again")

    monkeypatch.setattr(Setup, "plan", no_plan)
    second = fit_auto(x, y)
    assert second.last_plan is None and tk.plan.short_name(second.strategy) == tk.plan.short_name(first.strategy)
    with pytest.raises(AssertionError, match="planned again"):  # another batch size: another decision
        fit_auto(x, y, batch_size=32)


def test_a_remembered_pick_builds_its_state_as_the_planning_run_did(cache_in, monkeypatch):
    """The planning run measured its candidates from a state built under the first one that
    fits (SingleDevice) and trained the pick (FSDP) from it; a run that remembers the pick builds
    the state the same way, so every program comes from the compilation cache and the state is
    the same."""
    monkeypatch.setattr(tk.plan, "pick", lambda fitting: fitting[-1])  # FSDP, whatever the timings
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    events = []

    def listen(event, **kwargs):
        events.append(event)

    jax.monitoring.register_event_listener(listen)
    x, y = make_classification(64)
    auto = tk.strategies.Auto(candidates=[tk.SingleDevice(), tk.FSDP()], always_compare=True)
    try:
        trainers = []
        for _ in range(2):
            before = len(events)
            trainer = tk.Trainer(
                MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2), strategy=auto
            )
            trainer.fit((x, y), batch_size=16, epochs=1, verbose=0)
            trainers.append((trainer, sum(e.endswith("cache_misses") for e in events[before:])))
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)
        jax.monitoring.unregister_event_listener(listen)
    (planned, planned_misses), (remembered, remembered_misses) = trainers
    assert planned.last_plan is not None and remembered.last_plan is None
    assert tk.plan.short_name(remembered.strategy) == "FSDP(fsdp=8)"
    assert planned_misses > 0 and remembered_misses == 0, (planned_misses, remembered_misses)
    for a, b in zip(jax.tree.leaves(planned.get_weights()), jax.tree.leaves(remembered.get_weights())):
        assert (a == b).all()


def test_a_remembered_short_run_pick_is_not_reused_by_a_run_that_would_compare(cache_in, monkeypatch):
    # a host of 8 cores: a split could always gain, so some run length repays comparing. On the
    # 2 cores here the measured step may keep both busy, and then no run ever would
    # (compare_from_steps is inf, tested in test_auto_budget): nothing to check here
    monkeypatch.setattr(budget_lib, "host_cores", lambda: 8)
    x, y = make_classification(64)
    first = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2))
    first.fit((x, y), batch_size=16, epochs=1, verbose=0)
    from_steps = first.last_plan.compare_from_steps
    assert from_steps is not None and 8 < from_steps < math.inf, from_steps

    def fit_auto_for(*args, **kwargs):
        tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2)).fit(*args, **kwargs)

    def no_plan(*args, **kwargs):
        raise AssertionError("planned again")

    monkeypatch.setattr(Setup, "plan", no_plan)
    again = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2))
    again.fit((x, y), batch_size=16, epochs=2, verbose=0)  # 8 steps: still too short, remembered
    assert again.last_plan is None and tk.plan.short_name(again.strategy) == "SingleDevice"
    with pytest.raises(AssertionError, match="planned again"):
        fit_auto_for((x, y), batch_size=16, epochs=None, max_steps=int(from_steps), verbose=0)


def test_a_fresh_run_under_load_picks_the_strategy_the_first_run_planned(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env[compile_cache.ENVIRONMENT] = str(tmp_path / "cache")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # every program cached, as a long one would be
    script = ROOT / "tests" / "scripts" / "auto_pick.py"
    picks, misses = [], []
    for run in range(2):
        # a busy machine for the second run: a process spinning on each core
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 if run else 0)]
        try:
            command = [sys.executable, str(script)]
            result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        finally:
            for hog in hogs:
                hog.kill()
        assert result.returncode == 0, result.stderr[-3000:]
        picks.append(next(line for line in result.stdout.splitlines() if line.startswith("PICK")).split()[1:])
        misses.append(int(next(line for line in result.stdout.splitlines() if line.startswith("MISSES")).split()[1]))
    assert picks[0][1] == "planned" and picks[1][1] == "remembered", picks
    assert len({p[0] for p in picks}) == 1, picks
    # a remembered pick builds its state as the planning run did: every program comes from the cache
    assert misses[0] > 0 and misses[1] == 0, misses


class OuterMLP(MLP):
    """The same parameters as ``MLP``, and an outer product of each row in the forward pass."""

    @nn.compact
    def __call__(self, x):
        x = x + 0 * jnp.einsum("bi,bj->bij", x, x).sum(axis=(1, 2))[:, None]
        x = nn.relu(nn.Dense(self.features)(x))
        return nn.Dense(self.classes)(x)


def test_a_pick_is_remembered_for_the_computation_not_only_its_shapes(cache_in, monkeypatch):
    x, y = make_classification(64)
    first = fit_auto(x, y)
    assert first.last_plan is not None

    def no_plan(*args, **kwargs):
        raise AssertionError("planned again")

    monkeypatch.setattr(Setup, "plan", no_plan)
    shapes = [jax.eval_shape(m.init, jax.random.PRNGKey(0), x[:1]) for m in (MLP(), OuterMLP())]
    assert jax.tree.map(lambda a: a.shape, shapes[0]) == jax.tree.map(lambda a: a.shape, shapes[1])
    other = tk.Trainer(OuterMLP(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2))
    with pytest.raises(AssertionError, match="planned again"):  # same shapes, another computation
        other.fit((x, y), batch_size=16, epochs=1, verbose=0)


@pytest.mark.parametrize(
    "field",
    [{"initialised_under": ["x"]}, {"compare_from_steps": "many"}, {"strategy": 3}, {"compare_from_steps": True}],
)
def test_a_malformed_remembered_decision_means_plan_again(cache_in, field):
    x, y = make_classification(64)
    fit_auto(x, y)
    (path,) = (cache_in / "trainkit-auto").glob("*.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), **field}))
    again = fit_auto(x, y)  # not a TypeError: planned anew
    assert again.last_plan is not None and again.global_step == 4
