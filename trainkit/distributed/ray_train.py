"""Ray Train's worker group as a trainkit job: inside ``train_loop_per_worker`` of
``ray.train.v2.jax.JaxTrainer``, the Trainer (or ``tk.distributed.initialize()``) reads the
worker's rank from Ray's context and connects the workers through ``jax.distributed``; rank 0
picks the coordinator's address and Ray's collective shares it. Ray initialises JAX itself on
GPU and TPU workers (then nothing is done twice); on CPU workers nothing else does. Ray is
imported only where a Ray worker already imported it.

>>> worker_job() is None  # not inside a Ray Train worker
True
"""

from __future__ import annotations

import socket
import sys

from trainkit.distributed.engines import Job


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
    from ray.train.collective import broadcast_from_rank_zero

    address = None
    if ray.train.get_context().get_world_rank() == 0:
        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return str(broadcast_from_rank_zero(address))
