"""``strategy="auto"``'s choice, as one frozen :class:`Choice`: the strategy an earlier run of
the same setup picked (remembered in the compilation cache's folder,
:mod:`trainkit.planning.remembered`), or else the one the compiled plan recommends among the
candidates, with the plan, the candidate whose initialisation built the state, and the train
step the plan compiled (so it is not compiled again). The setup applies the choice; nothing
here changes it.

>>> import trainkit as tk
>>> [tk.plan.short_name(s) for s in candidates(tk.strategies.Auto(candidates=[tk.SingleDevice()]))]
['SingleDevice']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax

from trainkit import data as data_lib
from trainkit import distributed
from trainkit.core import tree
from trainkit.core.tree import PyTree
from trainkit.distributed import compile_cache
from trainkit.planning import ladder as ladder_lib
from trainkit.planning import plan as plan_lib
from trainkit.planning import remembered as remembered_lib
from trainkit.program.program import Program
from trainkit.program.state_access import StateAccess
from trainkit.strategies import Auto, Strategy
from trainkit.version import __version__


class Planner(Protocol):
    """What ``"auto"`` needs of a setup (:class:`~trainkit.program.setup.Setup` is one)."""

    program: Program
    custom_loss: bool
    state_access: StateAccess

    def require_auto(self) -> Auto: ...

    def computation(self, first_x: PyTree) -> str:
        """A digest of the model's forward pass traced on ``first_x``."""
        ...

    def ladder(self, first_x: PyTree) -> list[ladder_lib.Rung]:
        """The memory measures a plan tries when nothing fits."""
        ...

    def plan(
        self, prepared: data_lib.Prepared, candidates: Sequence[Strategy] | None, settings: plan_lib.PlanSettings
    ) -> plan_lib.MemoryPlan: ...


@dataclasses.dataclass(frozen=True)
class Choice:
    """What ``"auto"`` chose: the ``strategy`` and why (``reason``); the ``plan`` it chose from
    (``None``: remembered, nothing planned); the candidate whose initialisation builds the state
    (``None``: the strategy's own); the ``train_step`` the plan compiled for it (``None``: none),
    in ``compile_seconds``."""

    strategy: Strategy
    reason: str
    plan: plan_lib.MemoryPlan | None = None
    initialise_under: Strategy | None = None
    train_step: Callable[..., Any] | None = None
    compile_seconds: float = 0.0


def candidates(auto: Auto) -> list[Strategy]:
    """The strategies ``"auto"`` chooses from: its own, or the default ones of all devices."""
    return list(auto.candidates) if auto.candidates is not None else plan_lib.default_candidates()


def choose(setup: Planner, prepared: data_lib.Prepared, measure: bool = True, run_steps: int | None = None) -> Choice:
    """The strategy for ``prepared`` (ranked by the compiler's estimate, no step run, unless
    ``measure`` and the ``Auto`` measure); ``run_steps``: the steps of the run it is chosen for
    (``None``: unknown), which bounds the candidates worth compiling
    (``Auto(always_compare=True)``: all of them). A pick is remembered for the next run."""
    auto = setup.require_auto()
    measure = measure and auto.measure
    run_steps = None if auto.always_compare else run_steps
    key, remembered, under = remembered_pick(setup, prepared, measure, run_steps)
    if remembered is not None:
        same = under is None or plan_lib.short_name(under) == plan_lib.short_name(remembered)
        reason = f"picked {plan_lib.short_name(remembered)}, as an earlier run of this setup did"
        return Choice(remembered, reason, initialise_under=None if same else under)
    settings = plan_lib.PlanSettings(measure=measure, memory_limit=auto.memory_limit, run_steps=run_steps)
    result = setup.plan(prepared, auto.candidates, settings)
    best = result.recommended
    if best is None:
        raise ValueError(
            f"strategy='auto' found no strategy that runs this model and batch: {result.reason()}. "
            "Lower the batch size, pass remat='full' or grad_accum_steps=k, or pass "
            f"strategy=tk.strategies.Auto(memory_limit=...) or a strategy.\n{result}"
        )
    built_by = None if result.initialised_under is None else plan_lib.short_name(result.initialised_under)
    remembered_lib.remember(
        compile_cache.active_directory(), key, best.name, result.reason(), built_by, result.compare_from_steps
    )
    trains = prepared.has_targets or setup.custom_loss
    step = best.function if trains else None
    return Choice(best.strategy, result.reason(), result, train_step=step, compile_seconds=best.compile_seconds)


def remembered_pick(
    setup: Planner, prepared: data_lib.Prepared, measure: bool, run_steps: int | None = None
) -> tuple[str, Strategy | None, Strategy | None]:
    """The key of this setup's ``"auto"`` decision (measured or estimated), the candidate an
    earlier run picked for it (``None``: none remembered, not by every process alike, or
    picked without comparing candidates a run of ``run_steps`` steps would compare) and the
    one whose initialisation built that run's state (``None``: the pick's own)."""
    program, auto = setup.program, setup.require_auto()
    chosen_from = candidates(auto)
    devices = chosen_from[0].devices
    facts = {
        "state": tree.signature(program.abstract_state(prepared.first_x)),
        "batch": [prepared.batch_size, str(prepared.spec), prepared.has_targets or setup.custom_loss],
        "settings": setup.state_access.settings(),
        "remat": repr(program.remat),
        "offload": repr(program.offload),
        "log_grad_norm": program.steps.log_grad_norm,
        "devices": [len(devices), devices[0].platform, devices[0].device_kind, jax.process_count()],
        "candidates": [plan_lib.short_name(c) for c in chosen_from],
        "auto": [measure, auto.memory_limit],
        "versions": [jax.__version__, __version__],
        "computation": setup.computation(prepared.first_x),  # the same shapes may compute something else
        # how candidates are chosen: 2 leaves out those that change a result, 3 compares what pays, 4 adds
        # memory measures when nothing fits
        "rules": 4,
    }
    key = remembered_lib.decision_key(facts)
    decision = remembered_lib.recall(compile_cache.active_directory(), key, run_steps)
    name, under = (None, None) if decision is None else (decision["strategy"], decision.get("initialised_under"))
    if len(set(map(str, distributed.gather_json([name, under])))) > 1:  # the processes must agree, or all plan
        name = under = None
    named = {plan_lib.short_name(c): c for c in chosen_from}
    if name is not None and name not in named:  # configured (offload), or a measure the plan added
        configured, _ = program.configured_candidates(chosen_from, prepared.first_x)
        variants = configured + [
            measured
            for rung in setup.ladder(prepared.first_x)
            for measured in map(rung.applied, configured)
            if measured
        ]
        named |= {plan_lib.short_name(c): c for c in variants}
    return key, None if name is None else named.get(name), None if under is None else named.get(under)
