"""Which compiled step a ``fit`` with statistics (``GradientStats``) calls between its due steps.

Two programs serve such a fit one step per call: one that measures (on the due steps) and one
that does not (on the others, where measuring cost a dispatch-bound step twice its time). The
second is a second compile, which a short fit never repays: ``every=100`` cost a first fit of
1,000 steps more than ``every=1``. So the measuring step trains every step at first, and the
other one is compiled only once the steps have run as long as the first compile took (a
ski-rental rule: at most twice the better choice's cost, whatever the fit's length). Both give
the same parameters, bit for bit; the measuring step reports only on the due steps.

>>> plan = BetweenDue(every=100)
>>> plan.measures_between(now=0.0)          # nothing compiled yet: measure
True
>>> plan.first_call(started=0.0, ended=0.5)  # its compile took 0.5 s
>>> plan.measures_between(now=0.8), plan.measures_between(now=1.1)
(True, False)
>>> BetweenDue(every=1).measures_between(now=0.0)  # every step is due: nothing else to compile
True
"""

from __future__ import annotations


class BetweenDue:
    """Whether the steps between due ones still call the measuring step (see the module)."""

    def __init__(self, every: int):
        self.every = every
        self.until: float | None = None  # when the steps will have run as long as the first compile
        self.renting = every > 1

    def first_call(self, started: float, ended: float) -> None:
        """The fit's first call (it compiled the measuring step) ran from ``started`` to ``ended``."""
        if self.until is None:
            self.until = ended + (ended - started)

    def measures_between(self, now: float) -> bool:
        """Whether a step between due ones measures now (``now``: ``time.perf_counter()``)."""
        if self.renting and self.until is not None and now > self.until:
            self.renting = False  # from now on the step that measures nothing (compiled at its first call)
        return self.every == 1 or self.renting
