"""What a setup decided, one frozen :class:`Decisions` value replaced whole, held by a
:class:`Decided`: the strategy (``None`` under ``"auto"`` until planned), the batches per
training call and whether ``steps_per_execution="auto"`` still tunes them, the plan ``"auto"``
chose from, the inputs the state was built for, and a remembered pick's way to build the state.

>>> decided = Decided(Decisions(None, 1, tunes_steps=True))
>>> decided.decide_steps(4, "4 steps per call: 1.9x the steps/s of 1")
>>> decided.steps_per_execution, decided.tunes_steps
(4, False)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainkit.core.tree import PyTree
from trainkit.planning import plan as plan_lib
from trainkit.strategies import Strategy


@dataclasses.dataclass(frozen=True)
class Decisions:
    """What a setup decided (:meth:`Decided.decide` replaces it): the ``strategy`` (``None``
    under ``"auto"`` until planned), the batches per training call and whether
    ``steps_per_execution="auto"`` still tunes them, the ``plan`` ``"auto"`` chose from, the
    inputs the state was built for, and a remembered pick's way to build the state (the
    candidate whose initialisation built the planning run's state)."""

    strategy: Strategy | None
    steps_per_execution: int
    tunes_steps: bool
    #: ``steps_per_execution`` left to its default: fused only where the run repays the compile
    by_default: bool = False
    plan: plan_lib.MemoryPlan | None = None
    input_spec: PyTree = None
    initialise_under: Strategy | None = None


class Decided:
    """The current :class:`Decisions` (``value``), replaced whole by :meth:`decide`, and its reads."""

    def __init__(self, value: Decisions):
        self.value = value

    def decide(self, **changes: Any) -> None:
        """A new :class:`Decisions` value with ``changes`` (the old one is never edited)."""
        self.value = dataclasses.replace(self.value, **changes)

    def restore(self, value: Decisions) -> None:
        """``value`` back (a trial ``fit``'s decisions undone)."""
        self.value = value

    @property
    def strategy(self) -> Strategy | None:
        """The strategy (under ``"auto"``: ``None`` until planned)."""
        return self.value.strategy

    def require_strategy(self) -> Strategy:
        strategy = self.value.strategy
        if strategy is None:
            raise RuntimeError("No strategy is chosen yet: call fit(...) or init(sample_batch) first.")
        return strategy

    @property
    def steps_per_execution(self) -> int:
        return self.value.steps_per_execution

    @property
    def tunes_steps(self) -> bool:
        return self.value.tunes_steps

    @property
    def steps_by_default(self) -> bool:
        return self.value.by_default

    @property
    def last_plan(self) -> plan_lib.MemoryPlan | None:
        return self.value.plan

    @property
    def input_spec(self) -> PyTree:
        return self.value.input_spec

    def decide_steps(self, steps: int, reason: str) -> None:
        """``steps_per_execution="auto"`` picked ``steps`` batches per call: trained from the
        next span on, and recorded on the plan ``"auto"`` chose from (``trainer.last_plan``
        prints it), when there is one."""
        plan = self.value.plan
        if plan is not None:
            plan = dataclasses.replace(plan, decided={**plan.decided, "steps_per_execution='auto'": reason})
        self.decide(steps_per_execution=steps, tunes_steps=False, plan=plan)
