"""How many hosts the TPU slice this machine belongs to has, read from the environment alone, so
a single-host TPU machine (a v5e or v6e VM, a container, an air-gapped VM without GCE's metadata
server) never asks a metadata server it cannot reach. JAX's own cloud-TPU detection is asked for
the job only where the environment says the slice has several hosts, or says nothing and the
metadata server answers (:func:`trainkit.distributed.processes.job`).

What is read, first that says anything: the worker list GKE and queued resources set
(``TPU_PROCESS_ADDRESSES`` / ``TPU_WORKER_HOSTNAMES``), times ``MEGASCALE_NUM_SLICES``; a multi-slice
coordinator (``MEGASCALE_COORDINATOR_ADDRESS``: several); ``TPU_HOST_BOUNDS`` (``"2,2,1"``: 4 hosts);
the accelerator type (``TPU_ACCELERATOR_TYPE``, ``"v5litepod-16"``: 16 chips, 4 a host).

>>> hosts({"TPU_ACCELERATOR_TYPE": "v5litepod-1"}), hosts({"TPU_ACCELERATOR_TYPE": "v5litepod-16"})
(1, 4)
>>> hosts({"TPU_WORKER_HOSTNAMES": "t1k-0,t1k-1", "MEGASCALE_NUM_SLICES": "2"}), hosts({})
(4, None)
"""

from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Mapping

#: GCE's metadata server, as JAX's detection reaches it (``GCE_METADATA_IP`` overrides the host)
METADATA_HOST = "metadata.google.internal"
#: seconds to wait for the metadata server to accept a connection before calling it unreachable
METADATA_TIMEOUT = 2.0

#: what the error names when the environment says several hosts but the others cannot be found
WHAT_TO_SET = (
    "set TPU_WORKER_HOSTNAMES (every host of the slice, comma-separated, in worker order) and TPU_WORKER_ID "
    "(this host's place in it) on every host, or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID; "
    "or TRAINKIT_DISTRIBUTED=off to train on each host alone"
)

#: the variables :func:`hosts` reads
SLICE_VARIABLES = (
    "TPU_WORKER_HOSTNAMES",
    "TPU_PROCESS_ADDRESSES",
    "TPU_WORKER_ID",
    "MEGASCALE_NUM_SLICES",
    "MEGASCALE_SLICE_ID",
    "MEGASCALE_COORDINATOR_ADDRESS",
    "TPU_HOST_BOUNDS",
    "TPU_ACCELERATOR_TYPE",
    "ACCELERATOR_TYPE",
)

_ACCELERATOR = re.compile(r"^(?P<family>v\d+[a-z]*?)(?P<lite>litepod|e)?-(?P<count>\d+)$")


def hosts(env: Mapping[str, str] | None = None) -> int | None:
    """The number of hosts (processes) of the TPU slice or slices the environment describes; ``None``
    when it says nothing (a TPU VM that only GCE's metadata server describes, or no TPU at all)."""
    env = os.environ if env is None else env
    slices = _positive(env.get("MEGASCALE_NUM_SLICES")) or 1
    workers = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES")
    if workers:
        return len([host for host in workers.split(",") if host.strip()]) * slices
    if slices > 1 or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return max(slices, 2)
    bounds = env.get("TPU_HOST_BOUNDS", "")
    if re.fullmatch(r"\d+(,\d+)*", bounds.strip()):
        return math.prod(int(part) for part in bounds.split(","))
    accelerator = env.get("TPU_ACCELERATOR_TYPE") or env.get("ACCELERATOR_TYPE") or ""
    return accelerator_hosts(accelerator)


def accelerator_hosts(accelerator_type: str) -> int | None:
    """Hosts of a Cloud TPU accelerator type: ``v5litepod-N`` / ``v5e-N`` / ``v6e-N`` count chips
    (8 on one host up to 8, 4 a host past it); ``v2``-``v5p`` count TensorCores, 8 a host.
    ``None`` for a name of another form.

    >>> [accelerator_hosts(t) for t in ("v5litepod-8", "v6e-32", "v4-8", "v5p-64", "v3-32", "tpu7x")]
    [1, 8, 1, 8, 4, None]
    """
    match = _ACCELERATOR.match(accelerator_type.strip().lower())
    if match is None:
        return None
    count = int(match["count"])
    if match["lite"] or match["family"] in ("v6e", "v5e"):  # chips
        return 1 if count <= 8 else count // 4
    return max(1, count // 8)  # TensorCores: 4 chips of 2 cores a host


def metadata_reachable(env: Mapping[str, str] | None = None, timeout: float = METADATA_TIMEOUT) -> bool:
    """Whether GCE's metadata server accepts a connection within ``timeout`` seconds (its name
    resolves and port 80 answers): JAX's detection would otherwise fail with a raw
    ``ConnectionError``, or wait a minute a try."""
    env = os.environ if env is None else env
    address = env.get("GCE_METADATA_IP") or METADATA_HOST
    host, _, port = address.partition(":")
    try:
        with socket.create_connection((host, int(port or 80)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def described(env: Mapping[str, str] | None = None) -> str:
    """The variables that told :func:`hosts`, for a message: ``TPU_ACCELERATOR_TYPE=v5litepod-16``."""
    env = os.environ if env is None else env
    return ", ".join(f"{name}={env[name]}" for name in SLICE_VARIABLES if env.get(name)) or "nothing"


def _positive(value: str | None) -> int | None:
    return int(value) if value is not None and value.strip().isdigit() and int(value) > 0 else None


#: The port JAX's cloud-TPU detection gives the coordinator on the first worker (``coordinator_port``
#: in ``jax/_src/clusters/cloud_tpu_cluster.py``): processes started by either way meet there.
COORDINATOR_PORT = 8482


class SliceError(ValueError):
    """The environment describes a TPU slice in a way no job can be joined from (raised as a
    :class:`~trainkit.distributed.engines.JobError` by the caller)."""


def _count(env: Mapping[str, str], name: str, default: int | None, least: int) -> int | None:
    """``env[name]`` as an integer of at least ``least`` (``default`` when unset), else a
    :class:`SliceError` naming the variable and its value."""
    value = env.get(name)
    if value is None or not value.strip():
        return default
    if not value.strip().isdigit() or int(value) < least:
        raise SliceError(f"{name}={value!r} is not {'a positive' if least else 'a non-negative'} integer")
    return int(value)


def environment_job(env: Mapping[str, str] | None = None) -> tuple[str, int, int] | None:
    """``(coordinator_address, num_processes, process_id)`` of the slice the environment describes
    whole: the worker list (``TPU_PROCESS_ADDRESSES`` or ``TPU_WORKER_HOSTNAMES``) and this host's
    place in it (``TPU_WORKER_ID``), times ``MEGASCALE_NUM_SLICES`` (``MEGASCALE_SLICE_ID``: this
    slice's place), the coordinator on the first worker (or ``MEGASCALE_COORDINATOR_ADDRESS``) at
    JAX's port, as JAX's own detection computes them, without asking a metadata server. ``None``
    without a worker list; a :class:`SliceError` naming the variable where the values cannot be a
    job (an id that is not a number or past the list, counts that contradict each other).

    >>> environment_job({"TPU_WORKER_HOSTNAMES": "t-0,t-1", "TPU_WORKER_ID": "1"})
    ('t-0:8482', 2, 1)
    >>> environment_job({"TPU_WORKER_HOSTNAMES": "t-0,t-1", "TPU_WORKER_ID": "2"})
    Traceback (most recent call last):
    trainkit.distributed.tpu_slice.SliceError: TPU_WORKER_ID=2 is past the 2 workers of TPU_WORKER_HOSTNAMES (0 to 1)
    """
    env = os.environ if env is None else env
    listed = "TPU_PROCESS_ADDRESSES" if env.get("TPU_PROCESS_ADDRESSES") else "TPU_WORKER_HOSTNAMES"
    workers = [host.strip() for host in (env.get(listed) or "").split(",") if host.strip()]
    if not workers:
        return None
    if not (env.get("TPU_WORKER_ID") or "").strip() and len(workers) > 1:  # one worker: this host, alone
        raise SliceError(f"{listed} lists {len(workers)} workers but TPU_WORKER_ID (this host's place) is not set")
    worker = _count(env, "TPU_WORKER_ID", 0, 0)
    slices = _count(env, "MEGASCALE_NUM_SLICES", 1, 1)
    slice_id = _count(env, "MEGASCALE_SLICE_ID", 0, 0)
    assert worker is not None and slices is not None and slice_id is not None  # defaults given
    if worker >= len(workers):
        raise SliceError(
            f"TPU_WORKER_ID={worker} is past the {len(workers)} workers of {listed} (0 to {len(workers) - 1})"
        )
    if slice_id >= slices:
        raise SliceError(f"MEGASCALE_SLICE_ID={slice_id} is past MEGASCALE_NUM_SLICES={slices} (0 to {slices - 1})")
    accelerator = env.get("TPU_ACCELERATOR_TYPE") or env.get("ACCELERATOR_TYPE") or ""
    per_slice = accelerator_hosts(accelerator)
    if per_slice is not None and per_slice != len(workers):
        raise SliceError(
            f"{listed} lists {len(workers)} workers, but the accelerator type {accelerator!r} has {per_slice} "
            "host(s) a slice"
        )
    coordinator = (env.get("MEGASCALE_COORDINATOR_ADDRESS") or workers[0]).split(":")[0]
    return f"{coordinator}:{COORDINATOR_PORT}", len(workers) * slices, worker + slice_id * len(workers)
