"""Which engine started this process, and the job it belongs to, read from the environment alone
(no JAX backend, no network): trainkit's launcher and JAX's own variables, torchrun's, SLURM's
``srun``, Open MPI's ``mpirun``, an indexed Kubernetes Job. So the Trainer knows before its first
step whether it is one of N processes, and joins them, or refuses (never N silent copies).
Ray Train workers and TPU pods are asked by :mod:`trainkit.distributed.processes`, which can
talk to them.

>>> job = detect_job({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "4",
...     "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1"})
>>> job.engine, job.coordinator_address, job.num_processes, job.process_id, job.local_process_count
('slurm', 'node1:61447', 4, 3, 2)
>>> local_devices(job, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})  # this node's 4 GPUs, 2 tasks: the second pair
[2, 3]
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from collections.abc import Mapping

#: what turns every refusal below into one single-process training per task, on purpose
OPT_OUT = "TRAINKIT_DISTRIBUTED"


class JobError(RuntimeError):
    """This process sees it is one of several tasks of a job but cannot join the others."""


@dataclasses.dataclass(frozen=True)
class Job:
    """The multi-process job this process belongs to.

    ``coordinator_address`` ``None`` means the engine supplies it when the processes connect
    (Ray's rank 0 picks one; JAX's detection asks Kubernetes' API); ``detection`` is the
    ``cluster_detection_method`` JAX is given: ``"deactivate"`` when trainkit knows everything,
    so JAX's own detection (which can crash in a pod) never runs."""

    engine: str
    num_processes: int | None
    process_id: int | None
    coordinator_address: str | None
    local_process_id: int = 0
    local_process_count: int = 1
    detection: str | None = "deactivate"

    @property
    def several(self) -> bool:
        """Whether this is a job of more than one process (or one whose size only the engine knows)."""
        return self.num_processes is None or self.num_processes > 1


def environment_settings(env: Mapping[str, str] | None = None) -> tuple[str, int, int] | None:
    """``(coordinator_address, num_processes, process_id)`` from the environment a launcher set:
    JAX's own ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``
    (``trainkit.launch``, Kubeflow Trainer), torchrun's ``MASTER_ADDR`` / ``MASTER_PORT`` /
    ``WORLD_SIZE`` / ``RANK``, or ``JAX_MASTER_ADDR`` / ``JAX_PORT`` as some JAX guides write them
    (with ``JAX_NUM_PROCESSES`` or ``WORLD_SIZE``, and ``JAX_PROCESS_ID`` or ``RANK``). ``None``
    when none is set; a ``ValueError`` naming what is missing when one is half set.

    With torchrun the coordinator listens on ``MASTER_PORT + 1``: ``MASTER_PORT`` itself is
    torchrun's own rendezvous store, already bound on the first node.

    >>> environment_settings({"MASTER_ADDR": "node0", "MASTER_PORT": "29500", "WORLD_SIZE": "4", "RANK": "2"})
    ('node0:29501', 4, 2)
    """
    env = os.environ if env is None else env
    count = env.get("JAX_NUM_PROCESSES") or env.get("WORLD_SIZE")
    index = env.get("JAX_PROCESS_ID") or env.get("RANK")
    if env.get("JAX_COORDINATOR_ADDRESS"):
        address, source = env["JAX_COORDINATOR_ADDRESS"], "JAX_COORDINATOR_ADDRESS"
        count, index = env.get("JAX_NUM_PROCESSES"), env.get("JAX_PROCESS_ID")
        names = ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    elif env.get("JAX_MASTER_ADDR") or env.get("JAX_PORT"):
        address, source = _address(env, "JAX_MASTER_ADDR", "JAX_PORT", 0), "JAX_MASTER_ADDR / JAX_PORT"
        names = ("JAX_NUM_PROCESSES (or WORLD_SIZE)", "JAX_PROCESS_ID (or RANK)")
    elif env.get("MASTER_ADDR") or env.get("MASTER_PORT"):
        address, source = _address(env, "MASTER_ADDR", "MASTER_PORT", 1), "torchrun's MASTER_ADDR / MASTER_PORT"
        names = ("WORLD_SIZE", "RANK")
    else:
        return None
    missing = [name for name, value in zip(names, (count, index)) if value in (None, "")]
    if missing:
        raise ValueError(
            f"The environment sets {source} but not {' and '.join(missing)}: a multi-process job needs the "
            "coordinator address, the number of processes and this process's index. Set all three (or none)."
        )
    assert count is not None and index is not None  # checked just above
    count_name = "JAX_NUM_PROCESSES" if env.get("JAX_NUM_PROCESSES") else "WORLD_SIZE"
    index_name = "JAX_PROCESS_ID" if env.get("JAX_PROCESS_ID") else "RANK"
    return address, _whole(env, count_name), _whole(env, index_name)


def _whole(env: Mapping[str, str], name: str, default: str | None = None) -> int:
    """The environment variable ``name`` as a whole number (``default`` when unset), or a
    :class:`JobError` naming the variable and its value.

    >>> _whole({"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES")
    Traceback (most recent call last):
    ...
    trainkit.distributed.engines.JobError: JAX_NUM_PROCESSES='two' is not a whole number: ...
    """
    value = env.get(name, default)
    if value is None or value == "":
        raise JobError(f"{name} is not set, and this job's launcher needs it: set it for every process ({_EXPLICIT}).")
    try:
        return int(value)
    except ValueError:
        raise JobError(
            f"{name}={value!r} is not a whole number: the launcher (or a left-over export in the shell) set it wrong. "
            f"Set it to a number, or unset it."
        ) from None


def _address(env: Mapping[str, str], host_name: str, port_name: str, offset: int) -> str:
    missing = [name for name in (host_name, port_name) if not env.get(name)]
    if missing:
        present = port_name if missing[0] == host_name else host_name
        raise ValueError(
            f"The environment sets {present} but not {missing[0]}: the coordinator needs both a host and a port."
        )
    return f"{env[host_name]}:{_whole(env, port_name) + offset}"


def detect_job(env: Mapping[str, str] | None = None) -> Job | None:
    """The job the environment describes (see the module docstring), ``None`` for a process on
    its own; a :class:`JobError` naming the fix when the environment says this process is one of
    several but not how to reach the others. ``TRAINKIT_DISTRIBUTED=off`` opts out: every task
    trains on its own.

    >>> detect_job({}) is None
    True
    >>> detect_job({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"})
    Traceback (most recent call last):
    ...
    trainkit.distributed.engines.JobError: This process is rank 1 of 2 started by mpirun (OMPI_COMM_WORLD_SIZE=2), ...
    """
    env = os.environ if env is None else env
    if opted_out(env):
        return None
    settings = environment_settings(env)
    if settings is not None:
        address, count, index = settings
        engine = "kubernetes" if env.get("KUBERNETES_SERVICE_HOST") else _explicit_engine(env)
        if engine != "trainkit.launch":  # the launcher's children share one engine rank on purpose
            _refuse_other_ranks(env, index)
        local_id, local_count = _local_rank(env, ("LOCAL_RANK", "LOCAL_WORLD_SIZE"))
        return _checked(Job(engine, count, index, address, local_id, local_count))
    for read in (_slurm_job, _open_mpi_job, _pmi_job, _kubernetes_job):
        job = read(env)
        if job is not None:
            return _checked(job)
    _refuse_partial(env)
    return None


#: the rank each engine gives a process: where ``JAX_PROCESS_ID`` (or ``RANK``) says another, two
#: processes would claim one index and the job would hang
_ENGINE_RANKS = (("OMPI_COMM_WORLD_RANK", "mpirun"), ("SLURM_PROCID", "srun"), ("PMI_RANK", "an MPI launcher"),
                 ("PMIX_RANK", "an MPI launcher"))  # fmt: skip


def _refuse_other_ranks(env: Mapping[str, str], index: int) -> None:
    """A :class:`JobError` when an engine's rank and the explicit process index disagree."""
    given = "JAX_PROCESS_ID" if env.get("JAX_PROCESS_ID") else "RANK"
    for name, engine in _ENGINE_RANKS:
        if name == "SLURM_PROCID" and not env.get("SLURM_STEP_ID"):
            continue  # an sbatch script's own shell, not a task of srun
        value = env.get(name, "")
        if value.isdigit() and int(value) != index:
            raise JobError(
                f"{given}={env[given]} says this is process {index}, but {engine} made it rank {value} "
                f"({name}={value}): two processes would claim one index and the job would hang. Unset {given} (a "
                "left-over export?) "
                f"and let {engine}'s rank decide, or set it from it (JAX_PROCESS_ID=${name})."
            )


def _checked(job: Job) -> Job:
    """``job``, or a :class:`JobError` for a count below 1 or an index outside ``[0, count)``."""
    count, index = job.num_processes, job.process_id
    if count is not None and count < 1:
        raise JobError(f"The environment says the job has {count} processes: a job has at least 1. Fix or unset it.")
    if count is not None and index is not None and not 0 <= index < count:
        raise JobError(
            f"The environment says this is process {index} of {count}: indices run from 0 to {count - 1}. Fix the "
            "index (or the count) the launcher set, rather than this process training alone."
        )
    return job


def opted_out(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``TRAINKIT_DISTRIBUTED=off`` (or ``0``, ``false``, ``no``) asks every task to train on its own.

    >>> opted_out({"TRAINKIT_DISTRIBUTED": "Off"}), opted_out({})
    (True, False)
    """
    env = os.environ if env is None else env
    return env.get(OPT_OUT, "").strip().lower() in ("off", "0", "false", "no")


def _explicit_engine(env: Mapping[str, str]) -> str:
    if env.get("TRAINKIT_LAUNCH"):
        return "trainkit.launch"
    if env.get("JAX_COORDINATOR_ADDRESS") or env.get("JAX_MASTER_ADDR"):
        return "environment"
    return "torchrun"


def _local_rank(env: Mapping[str, str], names: tuple[str, str]) -> tuple[int, int]:
    local_id, local_count = (env.get(name) for name in names)
    if local_id is None or local_count is None:
        return 0, 1  # unknown: this process alone on its node
    return _whole(env, names[0]), _whole(env, names[1])


def _slurm_job(env: Mapping[str, str]) -> Job | None:
    """A task of ``srun`` (a job step): the coordinator is the step's first node, on JAX's port
    for the job (``SLURM_JOB_ID % 4096 + 61440``, or ``JAX_COORDINATOR_PORT``)."""
    names = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if not all(env.get(name) for name in names):
        return None
    port = env.get("JAX_COORDINATOR_PORT") or str(_whole(env, "SLURM_JOB_ID") % 4096 + 61440)
    local_count = _tasks_on_this_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""), _whole(env, "SLURM_NODEID", "0"))
    return Job(
        "slurm",
        _whole(env, "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"),
        _whole(env, "SLURM_PROCID"),
        f"{first_host(env['SLURM_STEP_NODELIST'])}:{port}",
        _whole(env, "SLURM_LOCALID"),
        local_count or 1,
    )


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list.

    >>> first_host("gpu[007-010,012],cpu1"), first_host("node3,node4"), first_host("localhost")
    ('gpu007', 'node3', 'localhost')
    """
    match = re.match(r"([^,\[]+)(?:\[([^,\-\]]+))?", nodelist)
    if match is None:
        raise JobError(f"SLURM_STEP_NODELIST={nodelist!r} is not a SLURM node list (e.g. 'node[1-4]').")
    return match.group(1) + (match.group(2) or "")


def _tasks_on_this_node(tasks_per_node: str, node: int) -> int | None:
    """Tasks of the step on node ``node`` from ``SLURM_STEP_TASKS_PER_NODE``.

    >>> _tasks_on_this_node("2(x3),1", 3), _tasks_on_this_node("4", 0), _tasks_on_this_node("", 0)
    (1, 4, None)
    """
    counts: list[int] = []
    for part in filter(None, tasks_per_node.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node] if node < len(counts) else None


def _open_mpi_job(env: Mapping[str, str]) -> Job | None:
    """A rank of Open MPI 4's ``mpirun``: the coordinator is the launcher's first address in
    ``OMPI_MCA_orte_hnp_uri`` on JAX's port for the job (Open MPI 5 sets no such URI: refused
    by :func:`_refuse_partial`, naming the fix)."""
    uri = env.get("OMPI_MCA_orte_hnp_uri")
    if not uri or not env.get("OMPI_COMM_WORLD_SIZE"):
        return None
    match = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)
    if match is None:
        raise JobError(f"OMPI_MCA_orte_hnp_uri={uri!r} names no TCP address for the coordinator; set {_EXPLICIT}.")
    host = next(group for group in match.groups() if group is not None)
    job_id = uri.split(".", 1)[0]
    if not job_id.isdigit():
        raise JobError(f"OMPI_MCA_orte_hnp_uri={uri!r} does not start with Open MPI's job number; set {_EXPLICIT}.")
    port = env.get("JAX_COORDINATOR_PORT") or str(int(job_id) // 4096 % 4096 + 61440)
    return Job(
        "openmpi",
        _whole(env, "OMPI_COMM_WORLD_SIZE"),
        _whole(env, "OMPI_COMM_WORLD_RANK"),
        f"{host}:{port}",
        *_local_rank(env, ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")),
    )


def _pmi_job(env: Mapping[str, str]) -> Job | None:
    """A rank of another MPI (MPICH, Intel MPI: ``PMI_SIZE``): joined through mpi4py when it is
    installed (JAX's opt-in ``mpi4py`` detection broadcasts rank 0's address)."""
    size_name = "PMI_SIZE" if env.get("PMI_SIZE") else "PMIX_SIZE"
    if not env.get(size_name) or _whole(env, size_name) < 2 or importlib.util.find_spec("mpi4py") is None:
        return None
    rank_name = "PMI_RANK" if env.get("PMI_RANK") else "PMIX_RANK"
    rank = _whole(env, rank_name) if env.get(rank_name) else None
    local = _local_rank(env, ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"))
    return Job("mpi", _whole(env, size_name), rank, None, *local, detection="mpi4py")


def _kubernetes_job(env: Mapping[str, str]) -> Job | None:
    """A pod of an indexed Job or JobSet (``JOB_COMPLETION_INDEX``) without ``JAX_*``: JAX's
    Kubernetes detection (the ``kubernetes`` package, a service account that may read pods)
    finds the coordinator and the count."""
    if not env.get("KUBERNETES_SERVICE_HOST") or env.get("JOB_COMPLETION_INDEX") in (None, ""):
        return None
    if importlib.util.find_spec("kubernetes") is None:
        return None  # refused by _refuse_partial, naming the fix
    return Job("kubernetes", None, _whole(env, "JOB_COMPLETION_INDEX"), None, detection=None)


_EXPLICIT = "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID"
#: the token a pod's service account mounts, with which JAX's Kubernetes detection reads the pods
SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def require_service_account(token: str = SERVICE_ACCOUNT_TOKEN) -> None:
    """A :class:`JobError` naming the fix when a pod left to JAX's Kubernetes detection (no
    ``JAX_*`` variables) has no service account token to read the pods with.

    >>> require_service_account("/nonexistent/token")
    Traceback (most recent call last):
    ...
    trainkit.distributed.engines.JobError: This pod is one of an indexed Kubernetes Job ...
    """
    if os.path.exists(token):
        return
    raise JobError(
        f"This pod is one of an indexed Kubernetes Job without {_EXPLICIT}, so JAX's Kubernetes detection would "
        f"find the others by reading the pods, but the pod has no service account token ({token}). Set the three "
        "JAX_* variables (the JobSet or Kubeflow Trainer set them; docs/clusters.md), or give the pod a service "
        "account that may list pods (automountServiceAccountToken)."
    )


def _refuse_partial(env: Mapping[str, str]) -> None:
    """A :class:`JobError` when the environment says this process is one of several tasks that
    no reader above could join: left alone, each would train its own copy."""
    signs = [
        ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "mpirun", "Open MPI 5 sets no OMPI_MCA_orte_hnp_uri"),
        ("PMI_SIZE", "PMI_RANK", "an MPI launcher (PMI)", "mpi4py is not installed"),
        ("PMIX_SIZE", "PMIX_RANK", "an MPI launcher (PMIx)", "mpi4py is not installed"),
        ("SLURM_NTASKS", "SLURM_PROCID", "srun", "a SLURM_STEP_* or SLURM_LOCALID variable is missing"),
        ("WORLD_SIZE", "RANK", "a torchrun-style launcher", "MASTER_ADDR and MASTER_PORT are not set"),
        ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "a JAX launcher", "JAX_COORDINATOR_ADDRESS is not set"),
    ]
    for size_name, rank_name, engine, why in signs:
        size = env.get(size_name, "")
        if size.isdigit() and int(size) > 1 and (size_name != "SLURM_NTASKS" or env.get("SLURM_STEP_ID")):
            rank = env.get(rank_name, "?")
            _refuse(f"rank {rank} of {size} started by {engine} ({size_name}={size}), but {why}")
    if env.get("KUBERNETES_SERVICE_HOST") and env.get("JOB_COMPLETION_INDEX"):
        index = env["JOB_COMPLETION_INDEX"]
        _refuse(
            f"pod {index} of an indexed Kubernetes Job (JOB_COMPLETION_INDEX={index}), but {_EXPLICIT} are not set "
            "and the `kubernetes` package JAX's detection reads the pods with is not installed"
        )


def _refuse(what: str) -> None:
    raise JobError(
        f"This process is {what}: it cannot join the other processes, and each would train its own copy. Set "
        f"{_EXPLICIT} for every process (docs/clusters.md shows how per engine), or set {OPT_OUT}=off to "
        "train one independent copy per task on purpose."
    )


def visible_gpus(env: Mapping[str, str] | None = None) -> int | None:
    """How many GPUs this process may use: the length of ``CUDA_VISIBLE_DEVICES`` (or ROCm's
    ``HIP_VISIBLE_DEVICES`` / ``ROCR_VISIBLE_DEVICES``) when set, else the ``/dev/nvidiaN``
    devices; ``None`` without a GPU.

    >>> visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5"}), visible_gpus({"CUDA_VISIBLE_DEVICES": ""})
    (2, None)
    """
    env = os.environ if env is None else env
    for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        if name in env:
            listed = [d for d in env[name].split(",") if d.strip() and d.strip() != "-1"]
            return len(listed) or None
    try:
        count = sum(1 for name in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", name))
    except OSError:
        return None
    return count or None


def local_devices(job: Job, env: Mapping[str, str] | None = None) -> list[int] | None:
    """The GPU ordinals this process takes (JAX's ``local_device_ids``), ``None`` for all it sees.

    The visible GPUs are split evenly among the job's processes on this node: one process per
    GPU (``--ntasks-per-node=8``, ``mpirun -np 8`` on an 8-GPU node) takes one each, one process
    per node (``--ntasks-per-node=1 --gpus-per-node=8``) all eight, two launched processes four
    each. Where the engine already gave each process its own GPUs (``--gpus-per-task``, Ray), a
    process sees fewer GPUs than there are processes on its node, and takes all it sees. No GPU,
    a TPU, or ``JAX_LOCAL_DEVICE_IDS`` set by the user: ``None``.

    >>> local_devices(Job("slurm", 8, 5, "n:1", 5, 8), {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})
    [5]
    >>> local_devices(Job("slurm", 4, 1, "n:1", 0, 1), {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}) is None
    True
    """
    env = os.environ if env is None else env
    gpus = visible_gpus(env)
    if gpus is None or env.get("JAX_LOCAL_DEVICE_IDS") or job.local_process_count <= 1:
        return None
    if gpus < job.local_process_count:
        return None  # the engine bound each process to its own GPUs
    if gpus % job.local_process_count:
        raise JobError(
            f"{job.local_process_count} processes of this {job.engine} job share this node's {gpus} GPUs, which do "
            "not split evenly. Start as many processes per node as GPUs (or one per node), or set "
            "JAX_LOCAL_DEVICE_IDS for each process."
        )
    each = gpus // job.local_process_count
    return list(range(job.local_process_id * each, (job.local_process_id + 1) * each))
