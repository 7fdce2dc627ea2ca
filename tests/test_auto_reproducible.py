"""``strategy="auto"`` repeats: a simpler strategy is kept unless another is clearly faster,
and the pick is remembered next to the compilation cache, so the next run of the same setup
picks the same at once, also on a busy machine."""

import os
import pathlib
import subprocess
import sys

import jax
import optax
import pytest
from conftest import MLP, make_classification

import trainkit as tk
from trainkit.distributed import compile_cache
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


def test_three_fresh_runs_pick_the_same_strategy_also_under_load(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env[compile_cache.ENVIRONMENT] = str(tmp_path / "cache")
    script = ROOT / "tests" / "scripts" / "auto_pick.py"
    picks = []
    for run in range(3):
        # a busy machine for the later runs: a process spinning on each core
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 if run else 0)]
        try:
            command = [sys.executable, str(script)]
            result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        finally:
            for hog in hogs:
                hog.kill()
        assert result.returncode == 0, result.stderr[-3000:]
        picks.append(next(line for line in result.stdout.splitlines() if line.startswith("PICK")).split()[1:])
    assert picks[0][1] == "planned" and [p[1] for p in picks[1:]] == ["remembered", "remembered"]
    assert len({p[0] for p in picks}) == 1, picks
