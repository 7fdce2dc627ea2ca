"""JAX's runtime internals: the distributed client, whether the backends started, the cloud-TPU and
cluster detection, the compilation cache's entry format and XLA's HLO cost analysis. Each function
answers without raising where the internal moved (the caller's fallback is named on each).

>>> distributed_client() is None  # a process on its own
True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import jax


class CoordinationClient(Protocol):
    """What trainkit asks of JAX's coordination-service client (``jax.distributed``'s)."""

    def wait_at_barrier(self, barrier_id: str, timeout_in_ms: int) -> None: ...

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = ...) -> None: ...

    def key_value_dir_get(self, key: str) -> Sequence[tuple[str, str]]: ...


def distributed_client() -> CoordinationClient | None:
    """The coordination client ``jax.distributed.initialize`` connected (``None``: not connected, or
    this JAX keeps it elsewhere: no barrier, no stall watchdog)."""
    try:
        from jax._src import distributed

        client: CoordinationClient | None = distributed.global_state.client
        return client
    except Exception:  # noqa: BLE001 - a private detail moved
        return None


def distributed_initialized() -> bool:
    """Whether ``jax.distributed.initialize`` ran in this process (the public check where this JAX
    has one)."""
    checker = vars(jax.distributed).get("is_initialized")
    if checker is not None:
        return bool(checker())
    return distributed_client() is not None


def backends_started() -> bool:
    """Whether JAX started its backends yet (``False`` where it cannot tell: the caller times the start)."""
    try:
        from jax._src import xla_bridge

        return bool(vars(xla_bridge).get("_backends"))
    except Exception:  # noqa: BLE001 - a private detail moved
        return False


def on_cloud_tpu_vm() -> bool:
    """Whether JAX's own check says this machine is a Cloud TPU VM."""
    from jax._src import cloud_tpu_init

    return bool(cloud_tpu_init.running_in_cloud_tpu_vm)


def tpu_slice_processes() -> tuple[str, int] | None:
    """``(detection, process count)`` of the TPU slice JAX's cluster detection (GCE's metadata, GKE's
    variables) finds around this host; ``None`` where neither describes one."""
    from jax._src import clusters

    for cluster in clusters.ClusterEnv._cluster_types:
        if cluster.name in ("gcetpu", "gketpu") and cluster.is_env_present():
            return cluster.name, int(cluster.get_process_count())
    return None


def check_cache_entry(data: bytes) -> None:
    """Raises where ``data`` (a persistent compilation cache entry's bytes) does not decompress as JAX
    would read it (zlib, zstd: whichever this JAX writes)."""
    from jax._src import compilation_cache

    compilation_cache.decompress_executable(data)


def hlo_cost(stage: jax.stages.Lowered | jax.stages.Compiled) -> Mapping[str, float]:
    """XLA's HLO cost analysis of a compiled executable's optimised module (or a lowered stage's
    module), run by the CPU client; ``{}`` where this JAX lacks it or it fails."""
    try:
        from jax._src.lib import _jax

        if isinstance(stage, jax.stages.Lowered):
            computation = stage.compiler_ir("hlo")
            if computation is None:
                return {}
            module = computation.as_hlo_module()
        else:
            executable = stage.runtime_executable()
            if executable is None:
                return {}
            module = executable.hlo_modules()[0]
        return dict(_jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module))
    except Exception:  # noqa: BLE001 - a private API, no CPU backend: no figure
        return {}
