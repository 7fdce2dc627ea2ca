"""What a plan adds when no candidate fits: the memory measures, in order of cost. First remat
of the model's repeated blocks (a third more forward compute), then the optimizer's state in
host memory (transfers beside the update), then both. Each measure is planned on the
candidates that were only too big, as rows of its own (``FSDP(fsdp=8) + remat``), and the
first measure under which one fits is the pick; the plan says what was added.

>>> [rung.name for rung in ladder(["Block"], can_offload=True)]
['remat', 'optimizer offload', 'remat and optimizer offload']
>>> [rung.name for rung in ladder([], can_offload=True)]  # no repeated blocks to rematerialise
['optimizer offload']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from trainkit.core.offload import Offload
from trainkit.core.remat import Remat
from trainkit.planning import plan as plan_lib
from trainkit.strategies import Strategy


@dataclasses.dataclass(frozen=True)
class Rung:
    """One measure: its ``name`` in the plan's reason, the ``remat`` it adds (``None``: none),
    and whether it keeps the optimizer's state in host memory."""

    name: str
    remat: Remat = None
    offload: bool = False

    def applied(self, strategy: Strategy) -> Strategy | None:
        """``strategy`` with this measure (``None``: it cannot offload, so the measure does not apply)."""
        if self.offload and not strategy.offloads:
            return None
        measured = strategy.with_remat(self.remat) if self.remat is not None else strategy
        return measured.with_offload(Offload(optimizer=True)) if self.offload else measured


def ladder(blocks: Sequence[str], *, can_offload: bool) -> list[Rung]:
    """The measures to try, cheapest first: remat of ``blocks`` (the repeated blocks' class
    names; none: no remat rung), optimizer offload (when the trainer's settings allow it), both."""
    rungs = []
    if blocks:
        rungs.append(Rung("remat", remat=list(blocks)))
    if can_offload:
        rungs.append(Rung("optimizer offload", offload=True))
    if blocks and can_offload:
        rungs.append(Rung("remat and optimizer offload", remat=list(blocks), offload=True))
    return rungs


def climbed(
    first: plan_lib.MemoryPlan, rungs: Callable[[], list[Rung]], plan: Callable[[list[Strategy]], plan_lib.MemoryPlan]
) -> plan_lib.MemoryPlan:
    """``first`` when a candidate fits; else each rung of ``rungs()`` planned in turn (``plan``)
    on the candidates that were only too big, until one fits: one plan of every row compiled,
    its pick and what was added; or, when none fits, all rows and no pick."""
    too_big = [row.strategy for row in first.rows if row.too_big]
    if first.recommended is not None or not too_big:
        return first
    rows = list(first.rows)
    for rung in rungs():
        candidates = [measured for measured in map(rung.applied, too_big) if measured is not None]
        if not candidates:
            continue
        result = plan(candidates)
        rows += result.rows
        if result.recommended is not None:
            return dataclasses.replace(result, rows=rows, added=rung.name, state_bytes=first.state_bytes)
    return dataclasses.replace(first, rows=rows)
