"""Processes: ``initialize`` over ``jax.distributed``, gathers across processes, the launcher,
the stall watchdog and the compilation cache (imports nothing else of trainkit).

>>> import trainkit as tk
>>> tk.distributed.is_main_process(), tk.distributed.process_count()
(True, 1)
"""

from trainkit.distributed.determinism import enable_determinism
from trainkit.distributed.processes import (
    GATHER_TIMEOUT,
    HEARTBEAT_TIMEOUT,
    broadcast_int,
    check_same_configuration,
    environment_settings,
    fetch,
    gather_json,
    initialize,
    initialize_from_environment,
    is_initialized,
    is_main_process,
    process_count,
    process_index,
    requested_by_environment,
    take_startup_seconds,
)

__all__ = [
    "GATHER_TIMEOUT",
    "HEARTBEAT_TIMEOUT",
    "broadcast_int",
    "check_same_configuration",
    "enable_determinism",
    "environment_settings",
    "fetch",
    "gather_json",
    "initialize",
    "initialize_from_environment",
    "is_initialized",
    "is_main_process",
    "process_count",
    "process_index",
    "requested_by_environment",
    "take_startup_seconds",
]
