"""One compile per fit (counted by JAX's own compile events), and the persistent compilation
cache: on in a user directory by default, moved or turned off by one setting."""

import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from conftest import CHILD_XLA_FLAGS, MLP, make_classification
from jax._src import dispatch

import trainkit as tk
from trainkit.distributed import compile_cache

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "startup_fit.py"


@pytest.fixture
def compiles():
    seen: list[str] = []

    def listener(event, duration=None, **kwargs):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            seen.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.parametrize("strategy", ["single", "dp", "fsdp"])
def test_one_compile_per_step_kind_in_a_fit_and_none_in_the_next(compiles, strategy):
    x, y = make_classification(70)  # batch 16: a ragged last batch of 6 rows every epoch
    at_epoch = []
    mark = tk.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs=None: at_epoch.append(len(compiles)))
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2), strategy=strategy)
    trainer.fit((x, y), batch_size=16, epochs=3, validation_data=(x[:30], y[:30]), callbacks=[mark], verbose=0)
    first_epoch = at_epoch[1]
    assert at_epoch[1] == at_epoch[2] == len(compiles), compiles  # none after the first epoch
    assert 2 <= first_epoch <= 4, compiles  # the state's init, the train and the eval step (+ a placement)
    before = len(compiles)
    trainer.fit((x, y), batch_size=16, epochs=2, validation_data=(x[:30], y[:30]), verbose=0)
    trainer.evaluate((x, y), batch_size=16)
    assert compiles[before:] == [], compiles[before:]  # the same batch size: nothing new


def test_a_new_seed_loads_the_initial_state_another_seed_compiled(tmp_path):
    """The seed's key is an argument of the compiled init, not a constant in it: a seed sweep
    with the persistent cache compiles the init once; each seed still gets its own numbers,
    those of ``jax.random.PRNGKey(seed)`` as before."""
    x, y = make_classification(32)
    from jax._src import compilation_cache as jax_compilation_cache

    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    jax_compilation_cache.reset_cache()
    try:
        trainers = [
            tk.Trainer(
                MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2), strategy="fsdp", seed=s
            )
            for s in (0, 7)
        ]
        for trainer in trainers:
            trainer.init((x, y))
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        jax_compilation_cache.reset_cache()
    assert len(list(tmp_path.glob("jit_init_state-*"))) == 1, os.listdir(tmp_path)  # one program for both seeds
    for seed, trainer in zip((0, 7), trainers):
        init_key, state_key = jax.random.split(jax.random.PRNGKey(seed))
        params_key, dropout_key = jax.random.split(init_key)
        expected = MLP().init({"params": params_key, "dropout": dropout_key}, x[:1])["params"]
        for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(trainer.params)):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(jax.device_get(trainer.state.rng), state_key)


def run_script(cache_setting, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["TRAINKIT_COMPILATION_CACHE"] = cache_setting
    env["XLA_FLAGS"] = CHILD_XLA_FLAGS  # compiled as this process compiles
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # JAX skips programs compiled in under 1 s
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    found = re.search(r"compiles=(\d+) cache_hits=(\d+) first_step=([\d.]+)", result.stdout)
    return int(found.group(1)), int(found.group(2)), float(found.group(3))


def test_a_second_run_loads_its_steps_from_the_cache_directory(tmp_path):
    directory = tmp_path / "cache"
    compiled, hits, _ = run_script(str(directory), tmp_path)
    assert hits == 0 and compiled >= 2 and len(os.listdir(directory)) >= 2
    compiled_again, hits_again, _ = run_script(str(directory), tmp_path)
    assert hits_again == compiled_again == compiled  # every compiled program came from disk


def test_the_cache_is_on_by_default_in_the_user_cache_directory_and_off_by_one_setting(tmp_path):
    run_script("off", tmp_path / "off")  # "" is off too: test_a_directory_the_user_gave_jax_is_kept
    assert not (tmp_path / "off" / "xdg").exists()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TRAINKIT_COMPILATION_CACHE")}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env["XLA_FLAGS"] = CHILD_XLA_FLAGS
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert len(os.listdir(tmp_path / "xdg" / "trainkit" / "jax")) >= 2


def test_a_directory_the_user_gave_jax_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache, "_configured", None)
    previous = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
        assert compile_cache.configure(str(tmp_path / "other")) == str(tmp_path / "mine")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)
    assert compile_cache.directory_for("OFF") is None
    assert compile_cache.directory_for(None) == compile_cache.default_directory()
    assert np.all([compile_cache.directory_for(v) is None for v in ("0", "false", "no", "none", " ", "", "OFF ")])
    # "on" is the default directory, never a folder named "on" in the working directory
    assert {compile_cache.directory_for(v) for v in ("on", "1", "true", "Yes", " ON")} == {
        compile_cache.default_directory()
    }


def test_auto_trains_with_the_plans_executable_and_initial_state_compiling_neither_again(compiles):
    x, y = make_classification(64)
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2))
    trainer.fit((x, y), batch_size=16, epochs=1, verbose=0)
    picked = type(trainer.strategy).__name__
    assert compiles.count("jit(init_state)") == 1, compiles  # the plan's, reused by the trainer
    # pmap's step is named jit(_fun); the forward pass that checks the outputs once is not a train step
    trains = [name for name in compiles if name not in ("jit(init_state)", "jit(outputs)")]
    compiled = [row for row in trainer.last_plan.rows if row.compiled is not None]
    assert len(trains) == len(compiled) >= 1, (picked, compiles)  # one per compiled candidate, none again
    single = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2), strategy="single")
    single.init((x, y))
    fresh = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2))
    fresh.init((x, y))
    for a, b in zip(jax.tree.leaves(jax.device_get(single.state)), jax.tree.leaves(jax.device_get(fresh.state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the planned state is the state at step 0


def startup_run(tmp_path, **env_settings):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(
        {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "XDG_CACHE_HOME": str(tmp_path / "xdg"), **env_settings}
    )
    env["XLA_FLAGS"] = CHILD_XLA_FLAGS
    if "TRAINKIT_COMPILATION_CACHE" not in env_settings:
        env.pop("TRAINKIT_COMPILATION_CACHE", None)
    return subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("where", ["a file", "under a file", "read-only"])
def test_an_unusable_cache_directory_warns_once_and_training_goes_on(tmp_path, where):
    (tmp_path / "file").write_text("not a directory")
    settings = {
        "a file": {"TRAINKIT_COMPILATION_CACHE": str(tmp_path / "file")},
        "under a file": {"TRAINKIT_COMPILATION_CACHE": str(tmp_path / "file" / "cache")},
        "read-only": {"XDG_CACHE_HOME": "/proc/self"},  # the default place, where nobody may create a directory
    }[where]
    result = startup_run(tmp_path, **settings)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("compilation cache directory") == 1, result.stderr
    assert "training goes on without the cache" in result.stderr and "TRAINKIT_COMPILATION_CACHE" in result.stderr
    assert re.search(r"compiles=[1-9]", result.stdout)


def test_a_truncated_cache_entry_is_replaced_instead_of_failing_every_run(tmp_path):
    directory = tmp_path / "cache"
    first = startup_run(tmp_path, TRAINKIT_COMPILATION_CACHE=str(directory))
    assert first.returncode == 0, first.stderr
    entries = sorted(directory.glob("*-cache"))
    assert entries
    entries[0].write_bytes(b"")  # a full disk: empty, and truncated
    for entry in entries[1:]:
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    second = startup_run(tmp_path, TRAINKIT_COMPILATION_CACHE=str(directory))
    assert second.returncode == 0 and "Error reading persistent compilation cache" not in second.stderr, second.stderr
    third = startup_run(tmp_path, TRAINKIT_COMPILATION_CACHE=str(directory))
    assert "Error reading persistent compilation cache" not in third.stderr, third.stderr
    compiled, hits = map(int, re.search(r"compiles=(\d+) cache_hits=(\d+)", third.stdout).groups())
    assert hits == compiled > 0  # rewritten by the second run, read back whole by the third


@pytest.mark.parametrize("x64", [False, True])
def test_the_host_seed_key_is_jax_s_key_for_every_seed(x64):
    from trainkit.core.state import seed_key

    seeds = [0, 7, -1, -5, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**32 + 5, 2**40 + 3, 2**63 - 1, -(2**63)]
    with jax.enable_x64(x64):
        for seed in seeds:
            np.testing.assert_array_equal(seed_key(seed), jax.random.key_data(jax.random.PRNGKey(seed)), err_msg=seed)
