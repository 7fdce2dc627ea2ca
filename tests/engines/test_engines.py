"""The engines users already run, for real on this machine (``make test-engines``): SLURM's daemons
on localhost, Open MPI's ``mpirun``, a Ray head. Each starts 2 processes x 2 fake CPU devices of
tests/scripts/engine_fit.py, which never calls ``tk.distributed.initialize()``: the Trainer joins
the job, and DataParallel and FSDP end with the bits of trainkit's own launcher. A rank killed
with SIGKILL ends the job within 10 s; a lost worker (Ray) or a failed job run again (SLURM)
resumes from BackupAndRestore's last backup, bit-identical, the lost steps counted. Each engine
skips with the reason where it is not installed. The seconds each run took are printed
(``-s``) for docs/clusters.md."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import clusters
import numpy as np
import pytest
from conftest import TEST_XLA_FLAGS, subprocess_cache_env

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "engine_fit.py"
RAY_DRIVER = ROOT / "tests" / "scripts" / "ray_fit.py"
#: mpirun as root, 2 ranks on 2 cores, its daemons on loopback (the coordinator is the launcher's first address)
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "oob_tcp_if_include", "lo"]
KILLED_WITHIN = 10.0  # seconds from a rank's SIGKILL to the job's end
FIGURES: dict[str, float] = {}


def cpu_env(**extra: str) -> dict[str, str]:
    """This environment for 2 fake CPU devices a process, without another engine's variables."""
    engine = re.compile(
        r"^(SLURM_|OMPI_|PMI|JAX_COORDINATOR|JAX_NUM_PROCESSES|JAX_PROCESS_ID|RAY_ADDRESS|WORLD_SIZE|RANK)"
    )
    env = {k: v for k, v in os.environ.items() if not engine.match(k) and k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env |= subprocess_cache_env(processes=2)
    env |= {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2", "PYTHONUNBUFFERED": "1"}
    env["XLA_FLAGS"] = " ".join([*TEST_XLA_FLAGS, "--xla_force_host_platform_device_count=2"])
    return env | extra


def run(command: list[str], env: dict[str, str], timeout: float = 300) -> tuple[int, str, float]:
    start = time.monotonic()
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    return result.returncode, result.stdout + result.stderr, time.monotonic() - start


def run_killed(command: list[str], env: dict[str, str], timeout: float = 300) -> tuple[int, str, float]:
    """Runs a job one of whose ranks kills itself; returns its code, output and the seconds from
    the kill (the time the rank printed) to the job's end."""
    code, output, _ = run(command, env, timeout)
    ended = time.time()
    died = re.search(r"process 1 dies now at ([\d.]+)", output)
    assert died, output
    return code, output, ended - float(died.group(1))


def load(path: pathlib.Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def assert_same_bits(result: dict[str, np.ndarray], reference: dict[str, np.ndarray], resumed_in: str = "") -> None:
    """The parameters and losses of DataParallel and FSDP, bit for bit; in the run that was
    ``resumed_in`` a strategy, its first epoch's loss covers the batches after the resume
    (docs/checkpointing.md) and is left out."""
    keys = [k for k in reference if not k.endswith("lost_steps")]
    assert len(keys) == 10 and set(keys) <= set(result)  # 2 strategies x (4 parameters + losses)
    for key in keys:
        skip = 1 if key == f"{resumed_in}/loss" else 0
        np.testing.assert_array_equal(result[key][skip:], reference[key][skip:], err_msg=key)


def first_step_seconds(output: str, started: float) -> float:
    return float(re.search(r"first step done at ([\d.]+)", output).group(1)) - started


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, np.ndarray]:
    """trainkit's launcher: 2 processes x 2 CPU devices."""
    out = tmp_path_factory.mktemp("launch") / "out.npz"
    env = {k: v for k, v in cpu_env().items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["XLA_FLAGS"] = " ".join(TEST_XLA_FLAGS)
    started = time.time()
    command = [
        sys.executable,
        "-m",
        "trainkit.launch",
        "--nproc",
        "2",
        "--devices-per-proc",
        "2",
        str(SCRIPT),
        str(out),
    ]
    code, output, seconds = run(command, env)
    assert code == 0, output
    assert "[0] trainkit: 2 processes (trainkit.launch) x 2 local cpu devices each = 4 devices" in output, output
    FIGURES["launch: run"], FIGURES["launch: first step"] = seconds, first_step_seconds(output, started)
    return load(out)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = clusters.missing("srun", "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged")
    if reason:
        pytest.skip(f"SLURM: {reason}")
    start = time.monotonic()
    with clusters.slurm(tmp_path_factory.mktemp("slurm")) as env:
        FIGURES["slurm: daemons up"] = time.monotonic() - start
        yield cpu_env(SLURM_CONF=env["SLURM_CONF"])


def test_srun_without_initialize_trains_one_job_with_the_launchers_bits(slurm, reference, tmp_path):
    started = time.time()
    code, output, seconds = run(["srun", "-n2", sys.executable, str(SCRIPT), str(tmp_path / "out.npz")], slurm)
    assert code == 0, output
    assert "trainkit: 2 processes (slurm) x 2 local cpu devices each = 4 devices" in output, output
    assert output.count("trainkit: 2 processes") == 1  # process 0 prints it
    assert "process 1 of 2 done" in output and "process 0 of 1" not in output  # one job, not two copies
    assert_same_bits(load(tmp_path / "out.npz"), reference)
    FIGURES["slurm: run"], FIGURES["slurm: first step"] = seconds, first_step_seconds(output, started)


def test_a_killed_srun_task_ends_the_job(slurm, tmp_path):
    command = ["srun", "-n2", sys.executable, str(SCRIPT), str(tmp_path / "o.npz"), "--strategies", "fsdp"]
    code, output, seconds = run_killed([*command, "--die-at", "3"], slurm)
    assert code != 0, output
    assert seconds < KILLED_WITHIN, output
    FIGURES["slurm: kill -9 to exit"] = seconds


def test_a_failed_slurm_job_run_again_resumes_bit_identical_counting_the_lost_steps(slurm, reference, tmp_path):
    """The job fails at step 10 of 48 (a task killed; backups every 4 steps), then the same
    ``srun`` runs again (as ``--requeue`` would): it resumes at step 8."""
    command = ["srun", "-n2", sys.executable, str(SCRIPT), str(tmp_path / "out.npz"), "--backup", str(tmp_path)]
    once = ["--die-at", "10", "--once", str(tmp_path / "died")]
    code, output, _ = run([*command, *once], slurm)
    assert code != 0 and "process 1 dies now" in output, output
    code, output, _ = run([*command, *once], slurm)
    assert code == 0, output
    result = load(tmp_path / "out.npz")
    assert_same_bits(result, reference, resumed_in="dp")
    assert int(result["dp/lost_steps"]) == 2 and int(result["fsdp/lost_steps"]) == 0  # steps 9 and 10


def test_the_guide_s_sbatch_script_trains_the_digits_as_one_job(slurm, tmp_path):
    """examples/clusters/slurm.sbatch (shown in docs/clusters.md), submitted as written."""
    log = tmp_path / "slurm.out"
    script = ROOT / "examples" / "clusters" / "slurm.sbatch"
    env = slurm | {"PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"}
    digits = ["--epochs", "1", "--min-accuracy", "0", "--verbose", "2", "--out", str(tmp_path / "run")]
    code, output, _ = run(["sbatch", "--wait", f"--output={log}", str(script), *digits], env)
    printed = log.read_text() if log.exists() else ""
    assert code == 0, output + printed
    assert "trainkit: 2 processes (slurm) x 2 local cpu devices each = 4 devices" in printed, printed
    assert re.search(r"test accuracy[^\n]*\d", printed, re.I), printed


def visible_devices(output: str) -> dict[str, str]:
    """Each process's visible GPUs as it printed them; the processes share one stream, unbuffered (a
    print's text and its newline are two writes), so one's line may run on into another's."""
    return dict(re.findall(r"process (\d+) visible devices ([\d,]+|all)", output))


def test_each_srun_task_and_each_launched_process_takes_its_share_of_the_gpus(slurm):
    """4 GPUs visible, 2 processes on the node: 2 each (JAX's own detection would give each
    task the one GPU numbered by its local rank, and the launcher's two processes both GPU 0)."""
    env = slurm | {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    code, output, _ = run(["srun", "-n2", sys.executable, str(SCRIPT), "--visible-devices"], env)
    assert code == 0, output
    assert visible_devices(output) == {"0": "0,1", "1": "2,3"}, output
    launch = ["srun", "-n1", sys.executable, "-m", "trainkit.launch", "--nproc", "2", str(SCRIPT), "--visible-devices"]
    code, output, _ = run(launch, env)
    assert code == 0, output
    assert visible_devices(output) == {"0": "0,1", "1": "2,3"}, output


@pytest.fixture(scope="module")
def mpirun():
    reason = clusters.missing("mpirun")
    if reason:
        pytest.skip(f"Open MPI: {reason}")
    return cpu_env()


def test_mpirun_without_initialize_trains_one_job_with_the_launchers_bits(mpirun, reference, tmp_path):
    started = time.time()
    code, output, seconds = run([*MPIRUN, "-np", "2", sys.executable, str(SCRIPT), str(tmp_path / "out.npz")], mpirun)
    assert code == 0, output
    assert "trainkit: 2 processes (openmpi) x 2 local cpu devices each = 4 devices" in output, output
    assert_same_bits(load(tmp_path / "out.npz"), reference)
    FIGURES["mpirun: run"], FIGURES["mpirun: first step"] = seconds, first_step_seconds(output, started)


def test_a_killed_mpirun_rank_ends_the_job(mpirun, tmp_path):
    command = [*MPIRUN, "-np", "2", sys.executable, str(SCRIPT), str(tmp_path / "o.npz"), "--strategies", "fsdp"]
    code, output, seconds = run_killed([*command, "--die-at", "3"], mpirun)
    assert code != 0, output
    assert seconds < KILLED_WITHIN, output
    FIGURES["mpirun: kill -9 to exit"] = seconds


def test_each_mpirun_rank_takes_its_gpu(mpirun):
    env = mpirun | {"CUDA_VISIBLE_DEVICES": "0,1"}
    code, output, _ = run([*MPIRUN, "-np", "2", sys.executable, str(SCRIPT), "--visible-devices"], env)
    assert code == 0, output
    assert visible_devices(output) == {"0": "0", "1": "1"}, output


@pytest.fixture(scope="module")
def ray():
    """A Ray head on loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps Ray from replacing
    127.0.0.1 with the machine's address: a single-node cluster)."""
    pytest.importorskip("ray.train", reason="Ray: pip install 'trainkit[ray]'")
    env = cpu_env(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    root = pathlib.Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # Ray's socket paths must stay short
    start = time.monotonic()
    with clusters.ray_head(root, env) as address:
        FIGURES["ray: head up"] = time.monotonic() - start
        yield env, address


#: Ray's controller collects the workers' reports every 2 s by default, and each report waits for
#: it: the runs that back up every 4 steps ask for every 0.25 s
EVERY_QUARTER_SECOND = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25"}


def ray_fit(ray, tmp_path, **options) -> tuple[int, str, float, float]:
    env, address = ray
    env = env | EVERY_QUARTER_SECOND if options.get("backup") else env
    started = time.time()
    command = [sys.executable, str(RAY_DRIVER), address, str(tmp_path / "storage"), str(tmp_path / "out.npz")]
    code, output, seconds = run([*command, json.dumps(options)], env, timeout=400)
    return code, output, seconds, started


def ray_records(tmp_path) -> dict:
    """What Ray recorded of the run (tests/scripts/ray_fit.py): every report's ``metrics`` and
    ``checkpoint`` (``reports``), the ``checkpoints``' names and the last ``checkpoint``'s."""
    return json.loads((tmp_path / "out.npz.ray.json").read_text())


def assert_epochs_reported(reports: list[dict], reference: dict[str, np.ndarray], strategies=("dp", "fsdp")) -> None:
    """Each fit reported its 4 epochs' losses (the uninterrupted run's), its epoch and step, in order."""
    epoch_ends = [r["metrics"] for r in reports if "loss" in r["metrics"]]
    expected = [(name, epoch) for name in strategies for epoch in range(4)]
    assert [(m["epoch"], m["step"]) for m in epoch_ends] == [(e, 12 * e + 12) for _, e in expected], reports
    losses = [float(reference[f"{name}/loss"][epoch]) for name, epoch in expected]
    np.testing.assert_allclose([m["loss"] for m in epoch_ends], losses, rtol=1e-6)


def test_a_ray_train_jax_trainer_on_cpu_workers_trains_the_launchers_bits(ray, reference, tmp_path):
    code, output, seconds, started = ray_fit(ray, tmp_path)
    assert code == 0, output
    assert "trainkit: 2 processes (ray) x 2 local cpu devices each = 4 devices" in output, output
    assert "Connecting to JAX distributed service on 127.0.0.1:" in output, output
    assert_same_bits(load(tmp_path / "out.npz"), reference)
    recorded = ray_records(tmp_path)  # every epoch's metrics reached Ray; no backup, no checkpoint
    assert_epochs_reported(recorded["reports"], reference)
    assert recorded["checkpoints"] == [] and recorded["checkpoint"] is None, recorded
    FIGURES["ray: run"], FIGURES["ray: first step"] = seconds, first_step_seconds(output, started)


def test_a_worker_group_on_fresh_machines_resumes_from_ray_s_checkpoint(ray, reference, tmp_path):
    """Each worker group writes its backups to a folder of its own (as fresh machines would), so
    the group Ray starts after a worker's exit at step 10 finds nothing there: it resumes from
    Ray's checkpoint of step 8 (the backups Ray recorded), bit-identical to the uninterrupted run."""
    options = {"backup": str(tmp_path / "backup"), "fresh_backup": True, "die_at": 10, "exit_code": True}
    code, output, _, _ = ray_fit(ray, tmp_path, **options, once=str(tmp_path / "died"))
    assert code == 0, output
    assert "process 1 dies now" in output, output
    result = load(tmp_path / "out.npz")
    assert_same_bits(result, reference, resumed_in="dp")
    assert int(result["dp/restored_step"]) == 8 and int(result["fsdp/restored_step"]) == -1, output
    recorded = ray_records(tmp_path)
    every_backup = [f"trainkit-{name}-step-{step}" for name in ("dp", "fsdp") for step in range(4, 48, 4)]
    assert recorded["checkpoints"] == sorted(every_backup), recorded  # step 8 of dp reported once
    assert recorded["checkpoint"] == "trainkit-fsdp-step-44", recorded


def test_the_guide_s_ray_example_trains_the_digits_as_one_job(ray, tmp_path):
    """examples/clusters/ray_digits.py (shown in docs/clusters.md), run as written."""
    env, address = ray
    example = ROOT / "examples" / "clusters" / "ray_digits.py"
    digits = ["--epochs", "1", "--min-accuracy", "0", "--verbose", "2", "--out", str(tmp_path / "run")]
    digits += ["--backup", str(tmp_path / "backup")]
    code, output, _ = run([sys.executable, str(example), *digits], env | {"RAY_ADDRESS": address}, timeout=400)
    assert code == 0, output
    assert "trainkit: 2 processes (ray) x 2 local cpu devices each = 4 devices" in output, output
    assert re.search(r"test accuracy[^\n]*\d", output, re.I), output
    assert re.search(r"Ray recorded \S+/trainkit-backup-step-\d+ with val_accuracy 0\.\d{3}", output), output


def test_a_killed_ray_worker_ends_the_run(ray, tmp_path):
    env, address = ray
    command = [sys.executable, str(RAY_DRIVER), address, str(tmp_path / "storage"), str(tmp_path / "o.npz")]
    options = {"strategies": "fsdp", "die_at": 3, "max_failures": 0}
    code, output, seconds = run_killed([*command, json.dumps(options)], env)
    assert code != 0, output
    assert seconds < KILLED_WITHIN, output
    FIGURES["ray: kill -9 to exit"] = seconds


def test_a_lost_ray_worker_costs_only_the_steps_since_the_last_backup(ray, reference, tmp_path):
    """A worker exits at step 10 of 48 (backups every 4 steps); Ray (``max_failures=1``) starts
    a new worker group, whose processes join a new job and resume from step 8: the final
    weights are those of the uninterrupted run, and the ledger counts 2 lost steps."""
    options = {"backup": str(tmp_path / "backup"), "die_at": 10, "exit_code": True, "once": str(tmp_path / "died")}
    code, output, _, _ = ray_fit(ray, tmp_path, **options)
    assert code == 0, output
    assert "process 1 dies now" in output, output
    result = load(tmp_path / "out.npz")
    assert_same_bits(result, reference, resumed_in="dp")
    assert int(result["dp/lost_steps"]) == 2 and int(result["fsdp/lost_steps"]) == 0


def test_ray_s_preemption_notice_writes_a_backup_and_the_fit_goes_on(ray, reference, tmp_path):
    """At step 14 the node is announced to be reclaimed (``ray drain-node``, reason preemption):
    Ray's notice makes BackupAndRestore write a backup at once (backups are otherwise at epoch
    ends: 12, 24, ...), Ray records it, and the fit ends with the uninterrupted run's bits. The
    last test of the Ray head: a drained node takes no new work (Ray's watcher looks every 0.2 s)."""
    env, address = ray
    options = {"strategies": "dp", "backup": str(tmp_path / "backup"), "save_freq": "epoch", "drain_at": 14}
    polled = env | {"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.2"}
    code, output, _, _ = ray_fit((polled, address), tmp_path, **options)
    assert code == 0, output
    assert "node drained at step 14" in output, output
    noticed = re.search(r"Ray announced a preemption; writing a backup of step (\d+)", output)
    assert noticed and 14 < int(noticed.group(1)) < 24, output
    FIGURES["ray: drain to backup (steps)"] = int(noticed.group(1)) - 14  # each step after the drain >= 0.1 s
    recorded = ray_records(tmp_path)
    epoch_ends = [f"trainkit-dp-step-{step}" for step in (12, 24, 36, 48)]
    assert recorded["checkpoints"] == sorted([*epoch_ends, f"trainkit-dp-step-{noticed.group(1)}"]), recorded
    result = load(tmp_path / "out.npz")
    for key in (k for k in reference if k.startswith("dp/") and not k.endswith("lost_steps")):
        np.testing.assert_array_equal(result[key], reference[key], err_msg=key)


def test_zz_figures():
    """Prints the seconds each engine took (run with ``-s``), for docs/clusters.md."""
    if not FIGURES:
        pytest.skip("no engine ran")
    for name, seconds in sorted(FIGURES.items()):
        print(f"{name:28s} {seconds:6.1f} s")
