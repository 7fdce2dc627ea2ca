"""Ray Train's worker group as a trainkit job: inside ``train_loop_per_worker`` of
``ray.train.v2.jax.JaxTrainer``, the Trainer (or ``tk.distributed.initialize()``) reads the
worker's rank from Ray's context and connects the workers through ``jax.distributed``; rank 0
picks the coordinator's address and Ray's collective shares it. Ray initialises JAX itself on
GPU and TPU workers (then nothing is done twice); on CPU workers nothing else does. Ray is
imported only where a Ray worker already imported it.

Ray's records: :func:`report` hands Ray the metrics and a ``BackupAndRestore`` backup (a Ray
checkpoint named ``trainkit-<backup folder>-step-<step>``); :func:`restore_latest` copies Ray's
latest checkpoint (``ray.train.get_checkpoint()``) back into the backup folder of that name, so
a worker group on fresh machines resumes; :func:`preemption_notice` asks Ray whether a node of
the group is being reclaimed. Each is a collective: every worker calls it the same number of times.

>>> worker_job() is None  # not inside a Ray Train worker
True
>>> checkpoint_name("/mnt/backup/dp", 8), step_of("trainkit-dp-step-8", "/elsewhere/dp")
('trainkit-dp-step-8', 8)
>>> step_of("trainkit-fsdp-step-8", "/mnt/backup/dp") is None  # another backup's checkpoint
True
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
from typing import Any, TypeVar

from trainkit.distributed.engines import Job

T = TypeVar("T")

#: a Ray checkpoint written by trainkit: the backup folder's name and the step
_CHECKPOINT = re.compile(r"^trainkit-(?P<name>.+)-step-(?P<step>\d+)$")


def worker_job() -> Job | None:
    """The Ray Train worker group this process is a worker of, ``None`` outside one."""
    if "ray" not in sys.modules:  # a Ray worker has imported it: nothing to ask otherwise
        return None
    import ray.train

    try:
        context = ray.train.get_context()
        size, rank = context.get_world_size(), context.get_world_rank()
    except RuntimeError:  # "get_context cannot be used outside of a Ray Train training function"
        return None
    return Job("ray", size, rank, None, context.get_local_rank(), context.get_local_world_size())


def coordinator_address() -> str:
    """Rank 0's node address and a free port on it, the same on every worker (Ray's collective:
    every worker of the group calls it)."""
    import ray
    import ray.train

    address = None
    if ray.train.get_context().get_world_rank() == 0:
        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return str(shared(address))


def checkpoint_name(backup_dir: str, step: int) -> str:
    """The Ray checkpoint's name for ``backup_dir``'s backup of ``step``: the folder's name
    identifies it (a fresh machine's backup folder may lie elsewhere)."""
    return f"trainkit-{os.path.basename(os.path.normpath(backup_dir))}-step-{step}"


def step_of(name: str, backup_dir: str) -> int | None:
    """The step of Ray checkpoint ``name`` when it is ``backup_dir``'s, else ``None``."""
    found = _CHECKPOINT.match(name)
    folder = os.path.basename(os.path.normpath(backup_dir))
    return int(found["step"]) if found and found["name"] == folder else None


def _local_steps(backup_dir: str) -> list[int]:
    names = os.listdir(backup_dir) if os.path.isdir(backup_dir) else []
    return [int(name) for name in names if name.isdigit()]


def restore_latest(backup_dir: str) -> int | None:
    """Copies Ray's latest checkpoint into ``backup_dir`` (as the orbax step it holds, by rank
    0) when it is this folder's backup and newer than every step the folder holds: a worker
    group restarted on fresh machines resumes where the last reported backup left off. Returns
    the step copied, ``None`` if none; every worker calls it (Ray's collective)."""
    import ray.train

    copied = None
    checkpoint = ray.train.get_checkpoint()
    if ray.train.get_context().get_world_rank() == 0 and checkpoint is not None:
        step = step_of(os.path.basename(os.path.normpath(checkpoint.path)), backup_dir)
        if step is not None and all(step > local for local in _local_steps(backup_dir)):
            os.makedirs(backup_dir, exist_ok=True)
            partial = os.path.join(backup_dir, f".ray-restore-{step}")
            shutil.rmtree(partial, ignore_errors=True)
            with checkpoint.as_directory() as source:
                shutil.copytree(source, partial)
            os.replace(partial, os.path.join(backup_dir, str(step)))  # whole, or not there
            copied = step
    return shared(copied)


def report(metrics: dict[str, Any], backup_dir: str | None = None, step: int | None = None) -> None:
    """``ray.train.report`` of ``metrics`` (numbers), with the backup of ``step`` in ``backup_dir``
    as Ray's checkpoint when given (rank 0 hands it over: the folder is shared by the workers, as
    orbax needs). Every worker calls it (it is Ray's barrier)."""
    import ray.train

    checkpoint = name = None
    if backup_dir is not None and step is not None and ray.train.get_context().get_world_rank() == 0:
        checkpoint = ray.train.Checkpoint.from_directory(os.path.join(backup_dir, str(step)))
        name = checkpoint_name(backup_dir, step)
    ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)


def preemption_notice() -> bool:
    """Whether Ray has announced that a node of this worker group is being reclaimed (Ray's
    ``get_preemption_info``: a barrier of the workers)."""
    import ray.train

    return ray.train.get_preemption_info() is not None


def shared(value: T) -> T:
    """Rank 0's ``value`` on every worker (Ray's collective)."""
    from ray.train.collective import broadcast_from_rank_zero

    result: T = broadcast_from_rank_zero(value)
    return result
