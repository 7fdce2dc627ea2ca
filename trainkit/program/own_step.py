"""The user's own step as a program runs it: the step value (``Trainer(step=...)``, or the
adapter of a ``train_step`` / ``test_step`` override; ``None``: the built-in step), the values
its traces were built from (a changed one retraces, or stops a fit it changed during), and which
value the first-batch audit (:mod:`trainkit.program.step_audit`) last checked.

>>> own = OwnStep(None, evaluates_alone=False)
>>> own.trains, own.tests, own.changed()
(False, False, [])
"""

from __future__ import annotations

import dataclasses

import jax

from trainkit.core import step_value
from trainkit.core.override_step import replacing
from trainkit.core.state import Batch, TrainState
from trainkit.core.step_state import StepState
from trainkit.core.step_value import Step, frozen_while_traced
from trainkit.core.tree import PyTree


class OwnStep:
    """``value``: the step value (``None``: the built-in step); ``evaluates_alone``: nothing but the
    step can evaluate (no ``loss=``, no ``compute_loss``), so its ``test`` runs (and names the fix)."""

    def __init__(self, value: Step | None, *, evaluates_alone: bool) -> None:
        self.value = value
        self._evaluates_alone = evaluates_alone
        self._traced: dict[str, object] | None = None  # the values the compiled steps were traced with
        self._audited: Step | None = None
        #: the names of the train step's logs, in their order (found when it is first traced)
        self.log_names: tuple[str, ...] | None = None

    @property
    def trains(self) -> bool:
        """The train step is the user's (the value's ``train``)."""
        return self.value is not None and self.value.trains

    @property
    def tests(self) -> bool:
        """The evaluation is the user's: the value's ``test``, or the step's where it trains and
        nothing else can evaluate."""
        return self.value is not None and (self.value.tests or (self.value.trains and self._evaluates_alone))

    def replace(self, new: object) -> None:
        """A new value (``trainer.step = dataclasses.replace(...)``): the next run traces with it."""
        self.value = replacing(self.value, new)

    def audit_due(self) -> bool:
        """It trains and this value has not been audited."""
        return self.trains and self.value is not self._audited

    def audited(self) -> None:
        self._audited = self.value

    def changed(self, forget: bool = True) -> list[str]:
        """``'name: old -> new'`` for each value the steps were traced with that has changed since
        (a hyperparameter of the value, a value an override read from ``self``); ``forget``: then
        forgotten (the next trace records them again)."""
        if self.value is None or self._traced is None:
            return []
        found = step_value.changed(self._traced, self.value.watched())
        if found and forget:
            self._traced = None
        return found

    def run(self, kind: str, state: StepState, batch: Batch, rng: jax.Array) -> PyTree:
        """The value's ``train`` (``kind`` ``"train_step"``) or ``test`` (``"test_step"``), traced:
        an attribute set on it refused by name, the values it read recorded (and the train step's
        logs' names, in their order)."""
        assert self.value is not None
        with frozen_while_traced(kind):
            if kind != "train_step":
                logs: PyTree = self.value.test(state, batch, rng)
                self._record(None)
                return logs
            result: PyTree = self.value.train(state, batch, rng)
        self._record(result)
        return result

    @property
    def traced(self) -> Step:
        """The value as the program compiles it: a step whose ``train`` and ``test`` are :meth:`run`'s
        (through the same seam, :meth:`Step.train_metrics`, as the built-in step's)."""
        return _Recorded(self)

    def _record(self, result: PyTree) -> None:
        self._traced = {**(self._traced or {}), **(self.value.traced_values() if self.value is not None else {})}
        if self.log_names is None and isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
            self.log_names = tuple(result[1])


@dataclasses.dataclass(frozen=True)
class _Recorded(Step):
    """The user's step value traced through its :class:`OwnStep` (an attribute set refused by
    name, the values it read and its logs' names recorded)."""

    own: OwnStep

    def train(self, state: StepState, batch: Batch, rng: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        result: tuple[TrainState, dict[str, jax.Array]] = self.own.run("train_step", state, batch, rng)
        return result

    def test(self, state: StepState, batch: Batch, rng: jax.Array) -> dict[str, jax.Array]:
        logs: dict[str, jax.Array] = self.own.run("test_step", state, batch, rng)
        return logs
