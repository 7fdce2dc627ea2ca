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
    "MEGASCALE_NUM_SLICES",
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
