"""A run's live record: the :class:`~trainkit.record.session.Session` (the live state, the
position, the flags and what a hook is about, written only through named events) and the goodput
:class:`~trainkit.record.ledger.Ledger` it holds (one clock switched between
:class:`~trainkit.record.ledger.Bucket` s). Here, not in ``core/``, because the ledger keeps a
clock, a thread-local and a process-wide listener; imports ``core`` only.

>>> from trainkit.record import Session
>>> Session().position.step
0
"""

from trainkit.record.ledger import Bucket, Goodput, Ledger
from trainkit.record.session import FitView, Position, Session, Snapshot, StepRecord

__all__ = ["Bucket", "FitView", "Goodput", "Ledger", "Position", "Session", "Snapshot", "StepRecord"]
