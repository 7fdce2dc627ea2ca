"""The loop: ``fit``, ``evaluate`` and ``predict`` over a trainer's compiled steps, on its
session (imports ``core``, ``data``, ``distributed``; ``strategies`` for types).

>>> from trainkit.loop import Position
>>> Position(epoch=1, batch=4, step=10).rebatched(8, 16)
Position(epoch=1, batch=2, step=10)
"""

from trainkit.core.totals import SKIPPED_WARNING
from trainkit.data.fit_config import FitConfig, Validation, validates
from trainkit.loop.dispatch import PREEMPTED_EXIT_CODE, Preempted, first_non_finite
from trainkit.loop.fit_run import FitRun
from trainkit.loop.hooks import BatchEndHook, CompiledSteps, ExceptionHook, Hook, Hooks, IndexedHook, Logs, RunHook
from trainkit.loop.loop import Loop
from trainkit.record.session import Position, Session, Snapshot, StepRecord

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "SKIPPED_WARNING",
    "CompiledSteps",
    "FitConfig",
    "FitRun",
    "Hook",
    "RunHook",
    "IndexedHook",
    "BatchEndHook",
    "ExceptionHook",
    "Logs",
    "Hooks",
    "Loop",
    "Position",
    "Preempted",
    "Session",
    "Snapshot",
    "StepRecord",
    "Validation",
    "first_non_finite",
    "validates",
]
