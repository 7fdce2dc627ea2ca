"""What the loop is given: the compiled steps it runs (``CompiledSteps``, the setup's side) and
the callbacks' hooks it calls (``Hooks``, a :class:`trainkit.callbacks.CallbackList`'s side).
Both are protocols, so the loop imports neither the setup nor the callbacks.

>>> class Printed(Hook):
...     active = True
...     def __call__(self, *args, **kwargs):
...         print("hook", *args)
>>> Printed()(3)
hook 3
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from trainkit.core.session import Session
from trainkit.core.spikes import SpikeSkip
from trainkit.core.totals import EpochTotals
from trainkit.core.tree import PyTree
from trainkit.data.prefetch import Prefetcher
from trainkit.data.source import Source
from trainkit.strategies import Strategy


class CompiledSteps(Protocol):
    """The loop's view of a trainer's setup (:class:`trainkit.program.setup.Setup` is one): the
    strategy that places batches and fetches outputs; the compiled steps by kind (``"train"``,
    ``"train_measured"``, ``"train_steps"``, ``"eval"``, ``"predict"``) and the host zeros of the metric totals the
    training and eval steps carry; the order of the logged metrics; the batches per compiled
    training call, which ``steps_per_execution="auto"`` decides while the loop runs."""

    @property
    def log_order(self) -> tuple[str, ...]: ...

    @property
    def steps_per_execution(self) -> int: ...

    @property
    def tunes_steps(self) -> bool:
        """``steps_per_execution="auto"`` not decided yet: the loop times the first steps."""
        ...

    def require_strategy(self) -> Strategy: ...

    def function(self, kind: str) -> Callable[..., Any]: ...

    @property
    def measured_every(self) -> int | None:
        """Every how many steps the train step measures statistics (``None``: never): the loop
        calls the ``"train_measured"`` step on those steps, the ``"train"`` step on the others."""
        ...

    def empty_totals(self, kind: str, host_batch: PyTree = None) -> EpochTotals: ...

    @property
    def spike_skip(self) -> SpikeSkip | None:
        """The train step's ``skip_spikes`` (its skips are reported, and a long run of them stops ``fit``)."""
        ...

    def decide_steps(self, steps: int, reason: str) -> None:
        """``steps_per_execution="auto"`` picked ``steps`` batches per call, for ``reason``."""
        ...

    def labels_message(self, count: int, value: int, where: str) -> str:
        """The error for ``count`` labels outside the classes (one of them ``value``) in ``where``."""
        ...


class Hook:
    """One hook of every callback that implements it (a subclass's ``__call__`` takes the hook's
    arguments); ``active``: whether any does (the loop then builds its arguments); ``period``
    (the train batch-end hook): the loop calls it only for the steps that cover a multiple of
    it (``None``: every batch)."""

    active: bool = False
    period: int | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError


class Hooks(Protocol):
    """Keras's hooks, each called on the callbacks in order, and what the callbacks declare:
    ``async_<kind>`` (every batch-end hook of that kind is ``async_safe``: the loop may run
    ahead), the most steps one call may cover, whether one profiles steps, and whether one stops
    at a non-finite loss."""

    on_train_begin: Hook
    on_train_end: Hook
    on_epoch_begin: Hook
    on_epoch_end: Hook
    on_train_batch_begin: Hook
    on_train_batch_end: Hook
    on_test_begin: Hook
    on_test_end: Hook
    on_test_batch_begin: Hook
    on_test_batch_end: Hook
    on_predict_begin: Hook
    on_predict_end: Hook
    on_predict_batch_begin: Hook
    on_predict_batch_end: Hook
    on_exception: Hook
    async_train: bool
    async_test: bool
    async_predict: bool

    @property
    def execution_cap(self) -> int | None: ...

    @property
    def annotates_steps(self) -> bool: ...

    @property
    def stops_on_non_finite(self) -> bool: ...


class LoopView(Protocol):
    """What a :class:`~trainkit.loop.fit_run.FitRun` uses of the loop that runs it: its session
    and compiled steps, its settings, its reader and its ``evaluate`` (validation)."""

    session: Session
    steps: CompiledSteps
    max_in_flight: int
    annotate_steps: bool

    def reader(self, dataset: Source, batches: Iterator, batch_size: int, read_ahead: bool = True) -> Prefetcher: ...

    def evaluate(
        self, dataset: Any, batch_size: int, steps: int | None, callbacks: Hooks, read_ahead: bool = True
    ) -> dict[str, float]: ...
