"""The loop: epochs and steps, the position, steps in flight, callback dispatch, resume and
preemption (imports ``core``, ``data``, ``distributed``; ``strategies`` for types).

>>> from trainkit.loop import Position
>>> Position(epoch=1, batch=4, step=10).rebatched(8, 16)
Position(epoch=1, batch=2, step=10)
"""

from trainkit.loop.loop import PREEMPTED_EXIT_CODE, SKIPPED_WARNING, Loop, Position, Preempted, StepRecord
from trainkit.loop.session import FitConfig, Session, Validation, validates

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "SKIPPED_WARNING",
    "FitConfig",
    "Loop",
    "Position",
    "Preempted",
    "Session",
    "StepRecord",
    "Validation",
    "validates",
]
