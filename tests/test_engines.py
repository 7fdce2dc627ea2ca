"""Which job a process belongs to, read from what each engine sets (the variables below are those
srun, mpirun, torchrun, Kubeflow Trainer and trainkit's launcher were seen to set on this machine,
tests/engines runs the engines themselves), the refusals that prevent N silent copies, and the
GPUs each process takes. A pod's environment with JAX's variables set trains (JAX's Kubernetes
detection, which crashed it, does not run)."""

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import subprocess_cache_env

from trainkit.distributed import Job, JobError, detect_job, local_devices

ROOT = pathlib.Path(__file__).parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "engine_fit.py"

#: srun -n2 (SLURM 22.05), task 1 of 2 on one node
SRUN = {
    "SLURM_JOB_ID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "localhost",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2",
}
#: mpirun -np 2 (Open MPI 4.1), rank 1
MPIRUN = {
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_MCA_orte_hnp_uri": "1671954432.0;tcp://127.0.0.1:37941",
}
#: a Kubeflow TrainJob's JAX runtime (one process per pod) in a pod
POD = {
    "KUBERNETES_SERVICE_HOST": "127.0.0.1",
    "KUBERNETES_SERVICE_PORT": "443",
    "JAX_COORDINATOR_ADDRESS": "trainjob-node-0-0.trainjob:1234",
    "JAX_NUM_PROCESSES": "4",
    "JAX_PROCESS_ID": "2",
}


@pytest.mark.parametrize(
    "env, expected",
    [
        (SRUN, Job("slurm", 2, 1, "localhost:61441", 1, 2)),
        (
            SRUN | {"JAX_COORDINATOR_PORT": "7000", "SLURM_STEP_NODELIST": "gpu[03-04]"},
            Job("slurm", 2, 1, "gpu03:7000", 1, 2),
        ),
        (MPIRUN, Job("openmpi", 2, 1, "127.0.0.1:64128", 1, 2)),
        (POD, Job("kubernetes", 4, 2, "trainjob-node-0-0.trainjob:1234")),
        (
            {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:9", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0",
             "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "TRAINKIT_LAUNCH": "1"} | SRUN,
            Job("trainkit.launch", 2, 0, "127.0.0.1:9", 0, 2),
        ),
        (
            {"MASTER_ADDR": "h", "MASTER_PORT": "29500", "WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1",
             "LOCAL_WORLD_SIZE": "4"},
            Job("torchrun", 8, 5, "h:29501", 1, 4),
        ),
        # sbatch's own script (not a step of srun): one process
        ({"SLURM_JOB_ID": "2", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, None),
        (SRUN | {"TRAINKIT_DISTRIBUTED": "off"}, None),
        ({}, None),
    ],
    ids=["srun", "srun-port", "mpirun", "pod", "launch-in-allocation", "torchrun", "batch-script", "opt-out", "alone"],
)  # fmt: skip
def test_each_engine_s_environment_is_one_job(env, expected):
    assert detect_job(env) == expected


@pytest.mark.parametrize(
    "env, says",
    [
        ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3"}, "rank 3 of 4 started by mpirun"),
        ({"PMI_SIZE": "2", "PMI_RANK": "0"}, "started by an MPI launcher (PMI) (PMI_SIZE=2), but mpi4py"),
        ({"WORLD_SIZE": "2", "RANK": "1"}, "MASTER_ADDR and MASTER_PORT are not set"),
        ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, "JAX_COORDINATOR_ADDRESS is not set"),
        ({k: v for k, v in SRUN.items() if k != "SLURM_STEP_NODELIST"}, "a SLURM_STEP_* or SLURM_LOCALID"),
        ({"KUBERNETES_SERVICE_HOST": "127.0.0.1", "JOB_COMPLETION_INDEX": "1"}, "pod 1 of an indexed Kubernetes Job"),
    ],
    ids=["open-mpi-5", "mpich", "torchrun-half", "jax-half", "srun-half", "indexed-job"],
)
def test_a_task_that_cannot_join_refuses_naming_the_fix(env, says, monkeypatch):
    if "PMI_SIZE" in env:  # with mpi4py, JAX's opt-in detection joins it
        monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    if "JOB_COMPLETION_INDEX" in env:  # with the kubernetes package, JAX's detection reads the pods
        monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(JobError, match=re.escape(says)) as error:
        detect_job(env)
    assert "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID" in str(error.value)
    assert "TRAINKIT_DISTRIBUTED=off" in str(error.value)
    assert detect_job(env | {"TRAINKIT_DISTRIBUTED": "off"}) is None


def test_an_indexed_job_without_jax_s_variables_is_left_to_jax_s_kubernetes_detection():
    pytest.importorskip("kubernetes")
    job = detect_job({"KUBERNETES_SERVICE_HOST": "127.0.0.1", "JOB_COMPLETION_INDEX": "3"})
    assert job == Job("kubernetes", None, 3, None, detection=None) and job.several


@pytest.mark.parametrize(
    "layout, visible, expected",
    [
        ("one process per GPU", ("0,1,2,3,4,5,6,7", 5, 8), [5]),
        ("one process per node", ("0,1,2,3,4,5,6,7", 0, 1), None),
        ("launcher: 2 processes on 8 GPUs", ("0,1,2,3,4,5,6,7", 1, 2), [4, 5, 6, 7]),
        ("--gpus-per-task=1 (the engine binds)", ("3", 3, 8), None),
        ("Ray: 2 GPUs per worker, 4 workers", ("4,5", 2, 4), None),
        ("no GPU", ("", 1, 2), None),
    ],
)
def test_each_process_takes_its_share_of_the_node_s_gpus(layout, visible, expected):
    devices, local_id, local_count = visible
    job = Job("slurm", 16, 0, "n:1", local_id, local_count)
    assert local_devices(job, {"CUDA_VISIBLE_DEVICES": devices}) == expected, layout


def test_gpus_that_do_not_split_evenly_are_refused():
    with pytest.raises(JobError, match="3 processes of this openmpi job share this node's 8 GPUs"):
        local_devices(Job("openmpi", 3, 0, "n:1", 0, 3), {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})
    assert local_devices(Job("openmpi", 3, 0, "n:1", 0, 3), {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
                                                             "JAX_LOCAL_DEVICE_IDS": "0"}) is None  # fmt: skip


def run_together(runs: list[tuple[list[str], dict[str, str]]], timeout: float = 300) -> list[str]:
    """Starts one process per ``(command, environment)`` at once; their outputs, once all exited 0."""
    processes = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        for command, env in runs
    ]
    outputs = [p.communicate(timeout=timeout)[0] for p in processes]
    assert [p.returncode for p in processes] == [0] * len(runs), outputs
    return outputs


def test_a_pod_s_environment_with_jax_s_variables_trains(tmp_path):
    """With the ``kubernetes`` package installed and ``KUBERNETES_SERVICE_HOST`` set (any pod),
    JAX's own detection ran even with all three ``JAX_*`` values given and died with
    ``ConfigException: Service token file does not exist``; trainkit turns it off when it knows
    the job. Two processes (a launcher's environment, plus a pod's variables) train."""
    pytest.importorskip("kubernetes")
    from trainkit.distributed.launch import build_env, free_port

    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    base |= subprocess_cache_env() | {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    envs = [build_env(base, process_id=i, nproc=2, port=port, devices_per_proc=2) for i in range(2)]
    command = [sys.executable, str(SCRIPT), str(tmp_path / "out.npz"), "--strategies", "fsdp"]
    outputs = run_together([(command, {k: v for k, v in env.items() if k != "TRAINKIT_LAUNCH"}) for env in envs])
    assert "trainkit: 2 processes (kubernetes) x 2 local cpu devices each = 4 devices" in outputs[0], outputs[0]
    assert "trainkit: 2 processes" not in outputs[1]  # process 0 prints the layout
    with np.load(tmp_path / "out.npz") as result:
        assert result["fsdp/loss"].shape == (4,)


def test_explicit_arguments_join_where_the_environment_alone_would_be_refused(tmp_path):
    """Open MPI 5's ranks (no launcher address) connected by ``initialize(address, count, id)``."""
    from trainkit.distributed.launch import free_port

    port = free_port()
    code = (
        "import sys, trainkit as tk, jax\n"
        f"tk.distributed.initialize('127.0.0.1:{port}', 2, int(sys.argv[1]))\n"
        "print('joined', jax.process_index(), jax.process_count(), flush=True)\n"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    ranks = [
        {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": str(rank), "JAX_PLATFORMS": "cpu"} for rank in range(2)
    ]
    outputs = run_together([([sys.executable, "-c", code, str(rank)], base | ranks[rank]) for rank in range(2)])
    assert "joined 1 2" in outputs[1], outputs[1]


def test_the_launcher_inside_a_multi_task_job_refuses():
    """``srun -n2 python -m trainkit.launch --nproc 2``: two launchers, two independent jobs."""
    from trainkit.distributed.launch import refuse_inside_a_job

    with pytest.raises(SystemExit, match=r"task 1 of a slurm job of 2 processes: each task would start its own"):
        refuse_inside_a_job(2, SRUN)
    refuse_inside_a_job(2, SRUN | {"SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_"))} | SRUN
    result = subprocess.run(
        [sys.executable, "-m", "trainkit.launch", "--nproc", "2", str(SCRIPT)], env=env, capture_output=True, text=True
    )
    assert result.returncode == 1 and "independent copies" in result.stderr, result.stderr


JAX_VARIABLES = {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:9", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}


@pytest.mark.parametrize(
    "env, says",
    [
        (JAX_VARIABLES | {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"},
         "JAX_PROCESS_ID=0 says this is process 0, but mpirun made it rank 1 (OMPI_COMM_WORLD_RANK=1)"),
        (JAX_VARIABLES | {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1"}, "but srun made it rank 1 (SLURM_PROCID=1)"),
        (JAX_VARIABLES | {"JAX_NUM_PROCESSES": "0"}, "the job has 0 processes"),
        (JAX_VARIABLES | {"JAX_PROCESS_ID": "2"}, "this is process 2 of 2: indices run from 0 to 1"),
        (JAX_VARIABLES | {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES='two' is not a whole number"),
        (SRUN | {"SLURM_STEP_NUM_TASKS": "2x"}, "SLURM_STEP_NUM_TASKS='2x' is not a whole number"),
        ({k: v for k, v in MPIRUN.items() if k != "OMPI_COMM_WORLD_RANK"}, "OMPI_COMM_WORLD_RANK is not set"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "p29500", "WORLD_SIZE": "2", "RANK": "0"}, "MASTER_PORT='p29500'"),
    ],
    ids=["mpirun-rank", "srun-rank", "zero-count", "index-past-count", "words", "slurm-words", "ompi-no-rank", "port"],
)  # fmt: skip
def test_an_environment_that_contradicts_itself_is_refused_naming_the_variables(env, says):
    """#59: a left-over JAX_PROCESS_ID overrode mpirun's rank (two processes claimed 0 and hung);
    a count of 0 or an index past it trained alone; words in numbers were raw ``int()`` errors."""
    with pytest.raises(JobError, match=re.escape(says)):
        detect_job(env)


def test_the_launcher_inside_an_allocation_keeps_its_own_ranks():
    env = JAX_VARIABLES | {"JAX_PROCESS_ID": "1", "TRAINKIT_LAUNCH": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}
    assert detect_job(env).process_id == 1  # its children share srun's rank 0 on purpose


def test_a_pod_left_to_jax_s_detection_without_a_service_account_is_refused_in_one_error():
    """#59: a pod without JAX_* and without a service account token ended in 12 lines of ConfigException."""
    pytest.importorskip("kubernetes")
    import subprocess
    import sys

    env = {**os.environ, "KUBERNETES_SERVICE_HOST": "127.0.0.1", "JOB_COMPLETION_INDEX": "1", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", "import trainkit.distributed as d; d.initialize_from_environment()"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1 and "kubernetes.config" not in result.stderr
    assert "JobError: This pod is one of an indexed Kubernetes Job without JAX_COORDINATOR_ADDRESS" in result.stderr
