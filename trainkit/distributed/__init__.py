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
    from trainkit.distributed.engines import Job, JobError, detect_job, environment_settings, local_devices
    from trainkit.distributed.processes import (
        GATHER_TIMEOUT,
        HEARTBEAT_TIMEOUT,
        broadcast_int,
        check_same_configuration,
        fetch,
        gather_json,
        global_replicas,
        initialize,
        initialize_from_environment,
        is_initialized,
        is_main_process,
        job,
        leave_now,
        process_count,
        process_index,
        requested_by_environment,
        take_startup_seconds,
    )

__all__ = [
    "GATHER_TIMEOUT",
    "HEARTBEAT_TIMEOUT",
    "Job",
    "JobError",
    "broadcast_int",
    "check_same_configuration",
    "detect_job",
    "enable_determinism",
    "environment_settings",
    "fetch",
    "gather_json",
    "global_replicas",
    "initialize",
    "initialize_from_environment",
    "is_initialized",
    "is_main_process",
    "job",
    "leave_now",
    "local_devices",
    "process_count",
    "process_index",
    "requested_by_environment",
    "take_startup_seconds",
]

#: the modules of the names not in processes.py
_MODULES = {"enable_determinism": "determinism"} | dict.fromkeys(
    ["Job", "JobError", "detect_job", "environment_settings", "local_devices"], "engines"
)
#: public name -> (module, attribute)
LAZY: dict[str, tuple[str, str | None]] = {
    name: (f"trainkit.distributed.{_MODULES.get(name, 'processes')}", name) for name in __all__
}

__getattr__ = lazy_attributes(globals(), LAZY)
