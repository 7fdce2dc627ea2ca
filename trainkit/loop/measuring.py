"""Which compiled step a ``fit`` with statistics (``GradientStats``) calls between its due steps
(:class:`BetweenDue`), and the epoch's totals as each takes them (:class:`SetAside`).

Two programs serve such a fit one step per call: one that measures (on the due steps) and one
that does not (on the others, where measuring cost a dispatch-bound step twice its time). The
second is a second compile, which a short fit never repays: ``every=100`` cost a first fit of
1,000 steps more than ``every=1``. So the measuring step trains every step at first, and the
other one is compiled only once the steps have run as long as the first compile took (a
ski-rental rule: at most twice the better choice's cost, however long the trainer trains; the
time is counted over its fits, not between them). Both give the same parameters, bit for bit;
the measuring step reports only on the due steps.

>>> plan = BetweenDue(every=100)
>>> plan.measures_between()
True
>>> plan.ran(0.5)                         # the first call: it compiled the measuring step
>>> plan.ran(0.3); plan.measures_between()
True
>>> plan.ran(0.3); plan.measures_between()  # 0.6 s of steps: worth the other compile now
False
>>> BetweenDue(every=1).measures_between()  # every step is due: nothing else to compile
True
"""

from __future__ import annotations

from trainkit.core.totals import Layout, PackedTotals, without_apart
from trainkit.core.tree import ArrayValue


class BetweenDue:
    """Whether the steps between due ones still call the measuring step (see the module); one
    per measuring program, kept by the loop across a trainer's fits."""

    def __init__(self, every: int):
        self.every = every
        self.compile_seconds: float | None = None  # the first call's, which compiled the measuring step
        self.spent = 0.0  # seconds of steps run since, measuring between due steps
        self.renting = every > 1  # while True, :meth:`ran` wants the seconds of each span of single steps

    def ran(self, seconds: float) -> None:
        """A span of single steps ran for ``seconds`` (the first one: the measuring step's compile)."""
        if self.compile_seconds is None:
            self.compile_seconds = seconds
            return
        self.spent += seconds
        if self.spent > self.compile_seconds:
            self.renting = False  # from now on the step that measures nothing (compiled at its first call)

    def measures_between(self) -> bool:
        """Whether a step between due ones calls the measuring step."""
        return self.every == 1 or self.renting


class SetAside:
    """One epoch's totals as each train step of a fit with statistics takes them: the measuring
    step the whole totals, the plain step those without the statistics' array, which waits here
    meanwhile (each buffer a dispatch-bound call takes and returns costs it about 3%: XLA copies
    an array passed through). The totals the loop hands on may be either: the statistics are read
    on their due steps only, which the measuring step ran.

    >>> import numpy as np
    >>> from trainkit.core.totals import EpochTotals, LossAverage, pack
    >>> from trainkit.core.statistics import PREFIX, DueValue
    >>> whole = pack(EpochTotals.empty({"loss": LossAverage(np.float32(0), np.float32(0)),
    ...                                 PREFIX + "values": DueValue(np.zeros(3, np.float32), np.float32(0))}))
    >>> aside = SetAside()
    >>> plain = aside.plain(whole)
    >>> len(whole.arrays), len(plain.arrays), aside.whole(plain).layout == whole.layout
    (2, 1, True)
    """

    def __init__(self) -> None:
        self.arrays: tuple[ArrayValue, ...] | None = None  # the arrays set aside (None: the totals are whole)
        self.layout: Layout | None = None  # the whole totals' layout

    def plain(self, totals: PackedTotals) -> PackedTotals:
        """``totals`` without the statistics' arrays (set aside here)."""
        if self.arrays is not None:
            return totals  # set aside already
        count, layout = without_apart(totals.layout)
        self.arrays, self.layout = totals.arrays[count:], totals.layout
        return PackedTotals(totals.arrays[:count], layout)

    def whole(self, totals: PackedTotals) -> PackedTotals:
        """``totals`` with the arrays set aside put back."""
        if self.arrays is None:
            return totals
        whole = PackedTotals(totals.arrays + self.arrays, self.layout)
        self.arrays = None
        return whole
