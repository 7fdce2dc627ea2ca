"""``Auto``: a strategy chosen from the compiler-measured plan at the first ``fit`` or ``init``.

``strategy="auto"`` (the Trainer's default) means ``Auto()``: on one device it is
``SingleDevice``; on several, the Trainer compiles the real train step under every candidate
(:func:`trainkit.planning.plan.default_candidates`) and keeps the fastest one whose per-device memory
fits, logging what it picked and why (see :meth:`trainkit.Trainer.plan`).

>>> auto = Auto(memory_limit=2**30, measure=False)
>>> auto.measure, auto.memory_limit
(False, 1073741824)
"""

from __future__ import annotations

from collections.abc import Sequence

from trainkit.core import checks
from trainkit.strategies.base import Strategy


class Auto:
    """How to choose a strategy; not a strategy itself. The Trainer turns it into the plan's
    recommended strategy before anything is compiled or placed (``trainer.strategy`` is
    ``None`` until then).

    Args:
        memory_limit: bytes one device may use (default: the accelerator's limit, or on CPU
            the host memory divided by the local devices).
        measure: time a few real steps of each fitting candidate (the default); ``False``
            ranks them by the compiler's cost estimate instead, which allocates nothing but is
            rough (on CPU, fake devices and convolutions defeat any simple cost model).
        candidates: the strategies to choose from (default: SingleDevice, DataParallel and
            FSDP; across processes DataParallel, FSDP and the Hybrid with data over the
            processes: :func:`trainkit.planning.plan.default_candidates`).
        always_compare: when measuring for ``fit``, compile and time every candidate. By
            default the simplest candidate that fits is timed first and each other one is
            compiled only when it could repay its compile and timing within the run's steps
            (:mod:`trainkit.planning.budget`): a short run starts at once.
    """

    def __init__(
        self,
        memory_limit: int | str | None = None,
        measure: bool = True,
        candidates: Sequence[Strategy] | None = None,
        always_compare: bool = False,
    ):
        self.memory_limit = checks.byte_count(memory_limit)
        self.measure = bool(measure)
        self.candidates = None if candidates is None else list(candidates)
        self.always_compare = bool(always_compare)

    def describe(self) -> str:
        return f"Auto(memory_limit={self.memory_limit}, measure={self.measure}, always_compare={self.always_compare})"
