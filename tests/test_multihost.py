"""Real multi-process runs on CPU: 2 processes x 4 fake devices (gloo) against 1 x 8, a process
that dies, a misconfigured process, checkpoints across process counts, and the launcher."""

import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from conftest import subprocess_cache_env

ROOT = pathlib.Path(__file__).parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "multihost_fit.py"


def clean_env(processes=2):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    return env | subprocess_cache_env(processes)


def start(nproc, devices, *args, env=None):
    """The launcher of ``nproc`` processes of ``devices`` fake devices each running the script, started."""
    command = [
        sys.executable,
        "-m",
        "trainkit.launch",
        "--nproc",
        str(nproc),
        "--devices-per-proc",
        str(devices),
        str(SCRIPT),
        *map(str, args),
    ]
    env = clean_env(nproc) | (env or {})
    output = tempfile.TemporaryFile("w+")  # not a pipe: a job started alongside another never waits on a full one
    return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT), output


def finish(started, start_time, timeout=420):
    """``(exit code, output, seconds since start_time)`` of a started launcher."""
    launcher, output = started
    try:
        launcher.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        launcher.kill()
        raise
    with output:
        output.seek(0)
        return launcher.returncode, output.read(), time.monotonic() - start_time


def launch(nproc, devices, *args, timeout=420, env=None):
    start_time = time.monotonic()
    return finish(start(nproc, devices, *args, env=env), start_time, timeout)


def load(path):
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


#: Adapters trained on 2 processes; the random-access ones shuffle as arrays do, the iterators are unshuffled.
ADAPTERS = {"grain-map": "arrays", "hf": "arrays", "torch-map": "arrays"} | dict.fromkeys(
    ["grain-iter", "torch-loader", "tf"], "arrays-96-in-order"
)
LIBRARIES = {"grain-map": "grain", "grain-iter": "grain", "hf": "datasets", "torch-map": "torch"} | {
    "torch-loader": "torch",
    "tf": "tensorflow",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    results = {}
    data = {1: "arrays,arrays-96-in-order", 2: ",".join(ADAPTERS)}
    slow = {1: (), 2: ("--slow-input-process", 1)}  # dp's rows read slowly by process 1 (the same numbers)
    # the 2-process job is given a JAX compilation cache of its own, which trainkit turns off there
    cache = {
        1: None,
        2: {"JAX_COMPILATION_CACHE_DIR": str(root / "jax-cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"},
    }
    launchers = {}  # both jobs at once: each waits on its own processes' collectives much of the time
    for nproc, devices in ((1, 8), (2, 4)):
        board, saves = root / f"board{nproc}", root / f"checkpoints{nproc}"  # saves: each strategy's, after epoch 2
        out = root / f"{nproc}x{devices}.npz"
        args = (out, "--data", data[nproc], "--tensorboard", board, "--save", saves, *slow[nproc])
        launchers[nproc] = (start(nproc, devices, *args, env=cache[nproc]), time.monotonic(), out, board, saves)
    for nproc, (launcher, started, out, board, saves) in launchers.items():
        code, output, _ = finish(launcher, started)
        assert code == 0, output
        results[nproc] = (load(out), output, board, saves)
    return results


@pytest.mark.parametrize("strategy", ["dp", "fsdp", "hybrid"])
def test_two_processes_give_the_parameters_of_one(runs, strategy):
    one, two = runs[1][0], runs[2][0]
    keys = [k for k in one if k.startswith(strategy + "/")]
    assert len(keys) >= 7 and set(keys) <= set(two)  # 4 parameters, loss, eval, predict
    for key in keys:
        np.testing.assert_allclose(two[key], one[key], rtol=2e-5, atol=2e-6, err_msg=key)
    assert two[f"{strategy}/predict"].shape == (100, 3)  # every row, in input order


def test_a_job_of_several_cpu_processes_runs_without_a_compilation_cache(runs):
    """JAX keys a CPU program by each process's devices and only process 0 writes; on jax 0.12.1 a
    step process 0 loads from the cache hangs with the one process 1 compiled. The cache the job
    was given (JAX_COMPILATION_CACHE_DIR) is turned off, with a warning, and holds nothing."""
    output, board = runs[2][1], runs[2][2]
    assert output.count("is turned off for this job of 2 processes on CPUs") == 2, output  # once per process
    cache = board.parent / "jax-cache"
    assert not cache.exists() or not [p for p in cache.iterdir() if p.name.endswith("-cache")]


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_each_data_adapter_on_two_processes_gives_the_parameters_of_arrays_on_one(runs, adapter):
    pytest.importorskip(LIBRARIES[adapter])
    one, two = runs[1][0], runs[2][0]
    keys = [k for k in two if k.startswith(adapter + "/")]
    assert len(keys) == 4  # the two Dense layers' kernels and biases
    for key in keys:
        reference = one[ADAPTERS[adapter] + key[len(adapter) :]]
        np.testing.assert_allclose(two[key], reference, rtol=2e-5, atol=2e-6, err_msg=key)


def test_only_process_0_writes_tensorboard_files(runs):
    pytest.importorskip("tensorboardX")
    for nproc in (1, 2):
        board = runs[nproc][2]
        files = sorted(str(p.parent.relative_to(board)) for p in board.rglob("events.out.tfevents.*"))
        expected = [f"{s}/train{h}" for s in ("dp", "fsdp", "hybrid") for h in ("", "/hparams")]
        assert files == expected, files  # one writer per run (and its HParams summary), not one per process


def test_output_is_prefixed_and_only_process_0_draws_progress(runs):
    output = runs[2][1]
    assert "[0] process 0 of 2 done" in output and "[1] process 1 of 2 done" in output
    epoch_lines = [line for line in output.splitlines() if "Epoch 1/3" in line]
    assert epoch_lines and all(line.startswith("[0] ") for line in epoch_lines)


def test_the_goodput_ledger_names_the_process_with_the_slow_source(runs):
    output = runs[2][1]
    tables = output.split("[0] Where the time went:")
    assert len(tables) == 4, output  # one per strategy, printed by process 0 only
    dp = tables[1].split("Epoch 1/3")[0]  # dp's table: the first
    assert re.search(r"\[0\] Process 1 spent the most in input: [\d.]+ s \(median process", dp), dp
    assert re.search(r"\[0\] Step time per process \(median / p99\): 0: .+, 1: .+\.", dp), dp
    for later in tables[2:]:  # fsdp, hybrid: both read arrays at the same pace
        assert "spent the most in input" not in later.split("Epoch 1/3")[0], later


def test_a_dead_process_is_reported_and_the_others_end(tmp_path):
    code, output, seconds = launch(2, 4, tmp_path / "out.npz", "--strategies", "fsdp", "--die-at-step", 3)
    assert code != 0
    assert "[1] process 1 dies now" in output
    assert "[launch] process 1 was killed by SIGKILL; ending the other processes" in output
    assert seconds < 120


def test_an_exception_in_one_process_ends_all_fast_naming_it(tmp_path):
    code, output, seconds = launch(2, 4, tmp_path / "out.npz", "--strategies", "fsdp", "--raise-at-step", 3)
    assert code != 0, output
    # process 1 exits with 1 (or is aborted by the coordination service once process 0 fails)
    assert re.search(r"\[launch\] process 1 .*\(RuntimeError: process 1 fails on purpose\)", output), output
    assert seconds < 60, output  # not JAX's 300 s shutdown barrier


def test_without_the_launcher_the_survivor_exits_with_an_error(tmp_path):
    sys.path.insert(0, str(ROOT))
    from trainkit.distributed.launch import build_env, free_port

    port = free_port()
    processes = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(tmp_path / "out.npz"), "--strategies", "dp", "--die-at-step", "3"],
            env=build_env(
                clean_env() | {"TRAINKIT_HEARTBEAT_TIMEOUT": "5"}, process_id=i, nproc=2, port=port, devices_per_proc=4
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        for i in range(2)
    ]
    assert processes[1].wait(timeout=180) == -9
    try:
        output, _ = processes[0].communicate(timeout=120)  # heartbeat timeout: 5 s here
    except subprocess.TimeoutExpired:
        processes[0].kill()
        pytest.fail("process 0 kept waiting for the dead process")
    assert processes[0].returncode != 0, output


def test_processes_with_different_settings_are_stopped_at_the_start(tmp_path):
    code, output, _ = launch(2, 4, tmp_path / "out.npz", "--strategies", "fsdp", "--seed-by-process", "--explicit-init")
    assert code != 0
    assert "The processes were started with different settings for seed: process 0:" in output


def test_a_gather_on_one_process_only_fails_clearly_within_seconds(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINKIT_GATHER_TIMEOUT", "5")
    code, output, seconds = launch(2, 4, tmp_path / "out.npz", "--strategies", "fsdp", "--gather-on-0-only")
    assert code != 0
    assert "[launch] process 0 exited with code 1 (RuntimeError: Process 0 waited 5 s for the other processes" in (
        output
    ), output
    assert "call it on every process" in output
    assert seconds < 60


def test_a_process_stalled_in_python_ends_the_run_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINKIT_STALL_TIMEOUT", "6")
    code, output, seconds = launch(2, 4, tmp_path / "out.npz", "--strategies", "dp", "--stall-at-step", 3)
    assert code != 0
    assert re.search(
        r"\[launch\] process 0 exited with code 1 \(trainkit.distributed.watchdog.StallError: process 1 has made no "
        r"progress for \d+ s \(last at step \d\)",
        output,
    ), output
    assert seconds < 90, output  # not the 300 s sleep


def test_processes_holding_different_rows_are_stopped_at_the_start(tmp_path):
    code, output, seconds = launch(2, 4, tmp_path / "out.npz", "--strategies", "dp", "--rows-by-process")
    assert code != 0
    assert 'different settings for batches, rows: process 0: {"batches": 7, "rows": 100}' in output, output
    assert seconds < 60


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_weights_saved_by_two_processes_are_those_of_one(runs, strategy):
    """``save_weights`` after the fixture's runs (called on every process; under DataParallel
    each holds pmap's replicas): one file, the final parameters, as one process writes it."""
    load_file = pytest.importorskip("safetensors.numpy").load_file
    one, two = (load_file(runs[n][3] / f"{strategy}.safetensors") for n in (1, 2))
    params = {k.split("/", 1)[1]: v for k, v in runs[1][0].items() if k.startswith(f"{strategy}/['")}
    assert sorted(one) == sorted(two) and len(one) == len(params) == 4
    assert sorted(np.asarray(v).size for v in one.values()) == sorted(np.asarray(v).size for v in params.values())
    for name in one:
        np.testing.assert_allclose(two[name], one[name], rtol=2e-5, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("save, load_", [(2, (1, 8)), (1, (2, 4))])
def test_a_checkpoint_moves_between_process_counts(runs, tmp_path, save, load_):
    """A checkpoint written by ``save`` processes (the fixture's run, after epoch 2; under
    DataParallel each process holds pmap's replicas) resumes on another process count for epoch
    3 and ends with the parameters of the uninterrupted run."""
    checkpoints = runs[save][3]
    code, output, _ = launch(*load_, tmp_path / "resumed.npz", "--strategies", "fsdp,dp", "--load", checkpoints)
    assert code == 0, output
    resumed, uninterrupted = load(tmp_path / "resumed.npz"), runs[1][0]
    keys = [k for k in uninterrupted if k.startswith(("fsdp/['", "dp/['"))]
    assert len(keys) == 8  # two strategies' 4 parameters
    for key in keys:
        np.testing.assert_allclose(resumed[key], uninterrupted[key], rtol=2e-5, atol=2e-6, err_msg=key)


def test_auto_picks_one_strategy_for_all_processes(tmp_path):
    """Each process times the candidates itself; all follow process 0's pick (or they would
    run different programs and hang)."""
    code, output, _ = launch(2, 4, tmp_path / "out.npz", "--strategies", "auto")
    assert code == 0, output
    assert "[0] strategy='auto' picked" in output and "[1] strategy='auto'" not in output
    assert "[1] process 1 of 2 done" in output
    # every candidate compiled on 2 processes, DataParallel's pmap too (lowered with the real state)
    rows = re.search(r"plan rows: (.*)", output).group(1)
    assert rows.count("=compiled") == 3 and "DataParallel(data=8)=compiled" in rows, rows
    assert "Hybrid(data=2, fsdp=4)=compiled" in rows, rows  # the data axis across the processes
    # and a pipeline across the processes, weighed, refused for a model without stacked blocks
    assert "Hybrid(stage=2, data=1, fsdp=4)=cannot pipeline this model" in rows, rows


def test_a_pipeline_with_a_stage_per_process_gives_one_devices_parameters(tmp_path):
    """Hybrid(stage=2, fsdp=4) on 2 processes x 4 devices: each process holds two of the four stacked
    layers, and only activations pass between the processes; the numbers are SingleDevice's."""
    code, output, _ = launch(2, 4, tmp_path / "pipeline.npz", "--strategies", "pipeline")
    assert code == 0, output
    code, output, _ = launch(1, 8, tmp_path / "single.npz", "--strategies", "single-stacked")
    assert code == 0, output
    pipeline, single = load(tmp_path / "pipeline.npz"), load(tmp_path / "single.npz")
    keys = [k for k in single if k.startswith("single-stacked/")]
    assert len(keys) >= 9  # 6 parameters, loss, eval, predict
    for key in keys:
        theirs = key.replace("single-stacked/", "pipeline/")
        # 1e-5: Adam's 21 steps turn the microbatches' other summation order into a few 1e-6 (one process does too)
        np.testing.assert_allclose(pipeline[theirs], single[key], rtol=2e-5, atol=1e-5, err_msg=key)


def test_an_iterable_is_refused_where_processes_share_their_rows(tmp_path):
    """A stage per process: both processes' devices take the same rows, and each process's iterable
    yields its own batches, which would be trained on as if the same; refused, naming what works."""
    code, output, _ = launch(2, 4, tmp_path / "out.npz", "--strategies", "pipeline-iterable")
    assert code != 0
    assert "an iterable yields each process its own batches" in output, output[-3000:]
    assert "Pass arrays or a random-access source" in output


def test_fused_steps_on_two_processes_give_the_parameters_of_single_steps_on_one(runs, tmp_path):
    """steps_per_execution=4 (one fused execution and 3 single steps per epoch), each process
    passing its rows of the stacked batches, under pmap and under jit."""
    code, output, _ = launch(2, 4, tmp_path / "fused.npz", "--strategies", "dp,hybrid", "--steps-per-execution", 4)
    assert code == 0, output
    fused, one = load(tmp_path / "fused.npz"), runs[1][0]
    keys = [k for k in one if k.split("/")[0] in ("dp", "hybrid") and k.split("/")[1] != "predict"]
    assert len(keys) >= 12
    for key in keys:
        np.testing.assert_allclose(fused[key], one[key], rtol=2e-5, atol=2e-6, err_msg=key)


def test_initialize_after_the_backend_started_says_to_call_it_first():
    code = (
        "import jax; jax.devices(); import trainkit as tk\n"
        "tk.distributed.initialize('127.0.0.1:1', num_processes=2, process_id=0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(1), cwd=ROOT)
    assert result.returncode != 0
    assert "must run before anything touches JAX's devices" in result.stderr


SLEEPER = """
import os, sys, time
import trainkit as tk
tk.distributed.initialize()  # JAX's preemption notifier now takes SIGTERM: the process stays on one
print("ready", os.getpid(), flush=True)
time.sleep(120)
"""


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split()[2] != "Z"


def start_launcher(tmp_path, nproc=2, source=SLEEPER):
    """``python -m trainkit.launch`` of ``source``, once each process printed "ready <pid>": ``(launcher, pids)``."""
    script = tmp_path / "launched.py"
    script.write_text(source)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "trainkit.launch", "--nproc", str(nproc), str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=clean_env(),
        cwd=ROOT,
    )
    pids = []
    while len(pids) < nproc:
        line = launcher.stdout.readline()
        assert line, "the launcher ended early"
        if "ready" in line:
            pids.append(int(line.split()[-1]))
    return launcher, pids


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_launcher_forwards_sigterm_and_sigint_and_leaves_no_child(tmp_path, signum):
    launcher, pids = start_launcher(tmp_path)
    launcher.send_signal(signum)
    output, _ = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signum, output
    assert f"[launch] received {signal.Signals(signum).name}, forwarded to every process" in output
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)


FAILING_PEER = """
import os, time
import trainkit as tk
tk.distributed.initialize()  # JAX's preemption notifier now takes SIGTERM: process 0 stays on one
print("ready", os.getpid(), flush=True)
if tk.distributed.process_index() == 1:
    time.sleep(1)
    raise RuntimeError("process 1 fails on purpose")
time.sleep(120)  # as a process waiting in a collective for the failed one
"""


def launched_until_done(tmp_path, source, marker, timeout):
    """The launcher of ``source`` run to its end: ``(launcher, output, when the line with marker came)``."""
    launcher, _ = start_launcher(tmp_path, source=source)
    lines, marked = [], None
    for line in launcher.stdout:
        lines.append(line)
        if marker in line:
            marked = time.monotonic()
    launcher.wait(timeout=timeout)
    return launcher, "".join(lines), marked


def test_after_a_process_fails_the_others_are_killed_within_a_second(tmp_path):
    """Not the 5 s a forwarded SIGTERM gets (a preemption, where each process writes its backup): a peer of a
    failed process waits in a collective, ignores SIGTERM, and would sit until JAX's heartbeat timeout."""
    launcher, output, ending = launched_until_done(tmp_path, FAILING_PEER, "ending the other processes", 60)
    assert launcher.returncode == 1 and ending is not None, output
    assert "[launch] process 1 exited with code 1 (RuntimeError: process 1 fails on purpose); ending the" in output
    assert time.monotonic() - ending < 3.0, output  # SIGTERM, then SIGKILL after PEER_FAILED_GRACE_SECONDS


def test_the_processes_die_with_a_killed_launcher(tmp_path):
    launcher, pids = start_launcher(tmp_path)
    launcher.kill()  # SIGKILL: no handler runs; the kernel tells the children (PR_SET_PDEATHSIG)
    launcher.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, None),
        ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, ("h:1", 2, 1)),
        (
            {"MASTER_ADDR": "h", "MASTER_PORT": "29500", "WORLD_SIZE": "8", "RANK": "3", "LOCAL_RANK": "3"},
            ("h:29501", 8, 3),
        ),
        ({"JAX_MASTER_ADDR": "h", "JAX_PORT": "7000", "WORLD_SIZE": "2", "RANK": "0"}, ("h:7000", 2, 0)),
        (
            {"JAX_COORDINATOR_ADDRESS": "h:1"},
            "sets JAX_COORDINATOR_ADDRESS but not JAX_NUM_PROCESSES and JAX_PROCESS_ID",
        ),
        ({"MASTER_ADDR": "h", "WORLD_SIZE": "2", "RANK": "0"}, "sets MASTER_ADDR but not MASTER_PORT"),
        (
            {"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "0"},
            "sets torchrun's MASTER_ADDR / MASTER_PORT but not WORLD_SIZE",
        ),
    ],
)
def test_launch_environments_users_arrive_with(env, expected):
    from trainkit.distributed import environment_settings

    if isinstance(expected, str):
        with pytest.raises(ValueError, match=re.escape(expected)):
            environment_settings(env)
    else:
        assert environment_settings(env) == expected


def test_a_torchrun_environment_connects_the_processes(tmp_path):
    from trainkit.distributed.launch import build_env, free_port

    port = free_port()
    processes = []
    for rank in range(2):
        env = build_env(clean_env(), process_id=rank, nproc=2, port=port, devices_per_proc=4)
        for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
            env.pop(name)
        env.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port - 1), WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank)
        )
        processes.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT), str(tmp_path / "out.npz"), "--strategies", "dp"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=ROOT,
            )
        )
    outputs = [p.communicate(timeout=180)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    assert "process 1 of 2 done" in outputs[1]


EXITING_PEER = """
import os, sys
import flax.linen as nn, numpy as np, optax
import trainkit as tk
tk.distributed.initialize()
print("ready", os.getpid(), flush=True)


class ExitAtStep3(tk.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if tk.distributed.process_index() == 1 and self.model.global_step >= 3:
            print("process 1 calls sys.exit(3)", flush=True)
            sys.exit(3)


x = np.random.default_rng(0).normal(size=(512, 4)).astype(np.float32)
trainer = tk.Trainer(nn.Dense(2), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy=tk.FSDP())
trainer.fit(x, (x[:, 0] > 0).astype(np.int32), batch_size=16, epochs=100, verbose=0, callbacks=[ExitAtStep3()])
"""


EXITING_BEFORE_FIT = """
import os, sys
import flax.linen as nn, numpy as np, optax
import trainkit as tk
tk.distributed.initialize()
print("ready", os.getpid(), flush=True)
trainer = tk.Trainer(nn.Dense(2), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy=tk.FSDP())
if tk.distributed.process_index() == 1:
    print("process 1 calls sys.exit(3) before fit", flush=True)
    sys.exit(3)
x = np.random.default_rng(0).normal(size=(512, 4)).astype(np.float32)
trainer.fit(x, (x[:, 0] > 0).astype(np.int32), batch_size=16, epochs=100, verbose=0)
"""


def test_a_sys_exit_before_fit_ends_the_job_naming_its_process_and_status(tmp_path):
    """#81 (MX1/MX4): ``sys.exit(3)`` on process 1 before ``fit`` ended the job at ~33 s with process 0 blamed
    (its collective's deadline) and the status 3 lost; the launcher's processes run the script through
    trainkit.distributed.script_runner, which sees the SystemExit: process 1 leaves at once with its status."""
    launcher, output, exited = launched_until_done(tmp_path, EXITING_BEFORE_FIT, "calls sys.exit(3) before fit", 120)
    assert exited is not None and time.monotonic() - exited < 30, output
    assert launcher.returncode == 3, output
    assert "[launch] process 1 exited with code 3" in output, output
    assert "process 1 of 2 leaves the job with exit status 3: SystemExit raised in" in output, output


def test_a_sys_exit_in_one_process_ends_the_job_with_its_status(tmp_path):
    """#81 (MX2): a callback's ``sys.exit(3)`` on process 1 at step 3 left both processes alive at 240 s (JAX's
    shutdown barrier waited for a peer stuck in a collective); now the job ends at once, the launcher naming
    process 1 and its status 3."""
    launcher, output, exited = launched_until_done(tmp_path, EXITING_PEER, "process 1 calls sys.exit(3)", 120)
    assert exited is not None and time.monotonic() - exited < 30, output
    assert launcher.returncode == 3, output
    assert "[launch] process 1 exited with code 3" in output, output
    assert "process 1 of 2 leaves the job with exit status 3: SystemExit raised in fit" in output, output
