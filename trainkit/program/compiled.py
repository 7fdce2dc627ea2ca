"""``CompiledFunctions``: a setup's compiled steps and the host zeros of the totals they carry,
each compiled (or traced) once and kept under what it computes: its kind (``"train"``,
``"train_measured"``, ``"train_steps"``, ``"eval"``, ``"predict"``) and the statistics a
``fit`` asks the training steps to measure (a ``GradientStats``). A fit that asks for other
statistics gets its own steps; nothing is recompiled when a later fit asks for the earlier ones
again, and the program itself never changes.

>>> import numpy as np, optax, flax.linen as nn, trainkit as tk
>>> trainer = tk.Trainer(nn.Dense(2), loss="mse", optimizer=optax.sgd(0.1), strategy="single")
>>> _ = trainer.fit(np.ones((8, 3), np.float32), np.ones((8, 2), np.float32), batch_size=4, verbose=0)
>>> compiled = trainer.compiled
>>> compiled.function("train") is compiled.function("train"), compiled.measured_every is None
(True, True)
"""

from __future__ import annotations

from collections.abc import Callable

from trainkit.core import cost
from trainkit.core.spikes import SpikeSkip
from trainkit.core.state import TrainState, abstract
from trainkit.core.statistics import StepStatistics
from trainkit.core.totals import EpochTotals
from trainkit.core.tree import PyTree, TreeFunction
from trainkit.program.decisions import Decided
from trainkit.program.program import Program
from trainkit.strategies import Strategy


class CompiledFunctions:
    """The compiled steps of ``program`` under the strategy ``decided`` holds, for the state
    ``state()`` (its shapes; the setup's live state once it exists): the
    :class:`~trainkit.loop.CompiledSteps` the loop runs, with the decisions it reads and the
    one it makes (``steps_per_execution="auto"``'s pick)."""

    def __init__(self, program: Program, decided: Decided, state: Callable[[], TrainState]):
        self.program, self.decided, self._state = program, decided, state
        self.statistics: StepStatistics | None = None  # what this fit's training steps measure
        self._functions: dict[tuple[str, StepStatistics | None], TreeFunction] = {}
        self._compiled_ahead: dict[tuple[str, StepStatistics | None], float] = {}  # seconds, where adopted
        self._totals: dict[tuple[str, StepStatistics | None], EpochTotals] = {}
        #: by kind (``"train"``, ``"eval"``, ``"predict"``): the named error for that run's inputs
        self._namers: dict[str, Callable[[BaseException], BaseException]] = {}

    def use_statistics(self, statistics: StepStatistics | None) -> None:
        """The training steps measure ``statistics`` for this ``fit``'s callbacks (``GradientStats``)."""
        self.statistics = statistics

    @property
    def measured_every(self) -> int | None:
        """The train step's statistics are due every this many steps (``None``: none measured):
        the loop then calls ``"train_measured"`` on those steps and ``"train"`` on the others."""
        return None if self.statistics is None else self.statistics.every

    @property
    def spike_skip(self) -> SpikeSkip | None:
        return self.program.spike_skip

    @property
    def log_order(self) -> tuple[str, ...]:
        return self.program.steps.log_order

    def labels_message(self, count: int, value: int, where: str) -> str:
        return self.program.objective.labels_message(count, value, where)

    @property
    def steps_per_execution(self) -> int:
        return self.decided.steps_per_execution

    @property
    def tunes_steps(self) -> bool:
        return self.decided.tunes_steps

    @property
    def steps_by_default(self) -> bool:
        return self.decided.steps_by_default

    def require_strategy(self) -> Strategy:
        return self.decided.require_strategy()

    def decide_steps(self, steps: int, reason: str) -> None:
        self.decided.decide_steps(steps, reason)

    def _key(self, kind: str) -> tuple[str, StepStatistics | None]:
        return kind, (None if kind in ("eval", "predict") else self.statistics)

    def function(self, kind: str) -> TreeFunction:
        """The compiled ``"train"``, ``"train_measured"``, ``"train_steps"``, ``"eval"`` or
        ``"predict"`` step (compiled once for this fit's statistics)."""
        key = self._key(kind)
        if key not in self._functions:
            state = abstract(self._state())
            self._functions[key] = self.program.compile(kind, self.decided.require_strategy(), state, self.statistics)
        return self._functions[key]

    def retrace_if_changed(self) -> list[str]:
        """Forgets the compiled steps when a plain value of the trainer a step of the user's own
        was traced with has changed since (``trainer.beta = 0`` between two fits): the next run
        traces them with the new value. Returns what changed (``'beta: 0.1 -> 0.0'``)."""
        changed = self.program.steps.own.changed()
        if changed:
            self._functions.clear()
        return changed

    def traced_values_changed(self) -> list[str]:
        """The plain values a step of the user's own reads as ``self.<name>`` that changed since it
        was traced (a callback's ``trainer.beta = ...`` during a fit), kept until the next run."""
        return self.program.steps.own.changed(forget=False)

    def has(self, kind: str) -> bool:
        """Whether the ``kind`` step is compiled (or adopted) for this fit's statistics."""
        return self._key(kind) in self._functions

    def name_out_of_memory(self, kind: str, namer: Callable[[BaseException], BaseException]) -> None:
        """``namer(device_error)`` names an out-of-memory error of this run's ``kind`` steps
        (:mod:`trainkit.program.out_of_memory`; set when the run's inputs are prepared)."""
        self._namers[kind] = namer

    def out_of_memory(self, kind: str, error: BaseException) -> BaseException:
        """trainkit's :class:`~trainkit.program.out_of_memory.OutOfMemory` for a device's
        out-of-memory ``error`` in a ``kind`` step (``error`` itself where no run named it)."""
        namer = self._namers.get(kind)
        return error if namer is None else namer(error)

    def adopt(self, kind: str, function: TreeFunction, compile_seconds: float = 0.0) -> None:
        """``function``, compiled elsewhere (the plan ``"auto"`` chose from, the memory check on an
        accelerator) in ``compile_seconds``, as the ``kind`` step."""
        self._functions[self._key(kind)] = function
        self._compiled_ahead[self._key(kind)] = compile_seconds

    def compiled_ahead_seconds(self, kind: str) -> float:
        """The seconds the ``kind`` step took to compile before its first call (:meth:`adopt`), 0.0 where
        its first call compiles it: what the steps tuner adds to that call to weigh a fused compile."""
        return self._compiled_ahead.get(self._key(kind), 0.0)

    def model_flops(self, x: PyTree) -> float:
        """One train step's flops on inputs ``x`` (global shapes) as the model's own matrix
        multiplies count them (:func:`trainkit.core.cost.model_flops`: remat and the compiler aside)."""
        return cost.model_flops(self.program.outputs, abstract(self._state()), x)

    def empty_totals(self, kind: str, host_batch: PyTree = None) -> EpochTotals:
        """Host zeros of the metric totals the ``kind`` step carries (``"train"``,
        ``"train_steps"`` or ``"eval"``), shaped once by tracing its metrics on a host batch."""
        key = self._key("eval" if kind == "eval" else "train")
        if key not in self._totals:
            if host_batch is None:
                raise ValueError("Pass a sample batch, e.g. trainer.lowered_text((x[:32], y[:32])), or call fit first.")
            state, axis = abstract(self._state()), self.decided.require_strategy().axis_name
            self._totals[key] = self.program.empty_totals(key[0], state, host_batch, axis, key[1])
        return self._totals[key]
