"""Processes: ``initialize`` over ``jax.distributed``, gathers across processes, the launcher,
the stall watchdog and the compilation cache (imports nothing else of trainkit). Its names are
imported on first use (:mod:`trainkit.distributed.lazy`): the launcher starts without JAX.

>>> import trainkit as tk
>>> tk.distributed.is_main_process(), tk.distributed.process_count()
(True, 1)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainkit.distributed.lazy import lazy_attributes

if TYPE_CHECKING:  # what __getattr__ imports on first use, for the type checker
    from trainkit.distributed.determinism import enable_determinism
    from trainkit.distributed.processes import (
        GATHER_TIMEOUT,
        HEARTBEAT_TIMEOUT,
        broadcast_int,
        check_same_configuration,
        environment_settings,
        fetch,
        gather_json,
        global_replicas,
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
    "global_replicas",
    "initialize",
    "initialize_from_environment",
    "is_initialized",
    "is_main_process",
    "process_count",
    "process_index",
    "requested_by_environment",
    "take_startup_seconds",
]

#: public name -> (module, attribute): enable_determinism's module, else processes.py
LAZY: dict[str, tuple[str, str | None]] = {
    name: (
        "trainkit.distributed.determinism" if name == "enable_determinism" else "trainkit.distributed.processes",
        name,
    )
    for name in __all__
}

__getattr__ = lazy_attributes(globals(), LAZY)
