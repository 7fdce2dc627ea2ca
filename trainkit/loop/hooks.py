"""What the loop is given: the compiled steps it runs (``CompiledSteps``, the setup's side) and
the callbacks' hooks it calls (``Hooks``, a :class:`trainkit.callbacks.CallbackList`'s side).
Both are protocols, so the loop imports neither the setup nor the callbacks.

>>> class Printed(IndexedHook):
...     active = True
...     def __call__(self, index, logs=None):
...         print("hook", index, logs)
>>> Printed()(3, {"loss": 0.5})
hook 3 {'loss': 0.5}
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from trainkit.core.spikes import SpikeSkip
from trainkit.core.totals import EpochTotals
from trainkit.core.tree import PyTree
from trainkit.data.prefetch import Prefetcher
from trainkit.data.source import Source
from trainkit.loop.measuring import BetweenDue
from trainkit.loop.tuning import Timings
from trainkit.record.session import Session
from trainkit.strategies import Strategy

T = TypeVar("T")


class CompiledSteps(Protocol):
    """The loop's view of a trainer's setup (:class:`trainkit.program.compiled.CompiledFunctions`): the
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

    @property
    def steps_by_default(self) -> bool:
        """``steps_per_execution`` left to its default: the loop fuses steps only where the
        host time a fit saves repays compiling the fused program."""
        ...

    def require_strategy(self) -> Strategy: ...

    def function(self, kind: str) -> Callable[..., Any]: ...

    def compiled_ahead_seconds(self, kind: str) -> float:
        """The seconds the ``kind`` step took to compile before its first call (0.0: its first call compiles it)."""
        ...

    def out_of_memory(self, kind: str, error: BaseException) -> BaseException:
        """trainkit's named error for a device's out-of-memory ``error`` in a ``kind`` step."""
        ...

    @property
    def measured_every(self) -> int | None:
        """Every how many steps the train step measures statistics (``None``: never): the loop
        calls the ``"train_measured"`` step on those steps, the ``"train"`` step on the others."""
        ...

    def empty_totals(self, kind: str, host_batch: PyTree = None) -> EpochTotals: ...

    def model_flops(self, x: PyTree) -> float:
        """One train step's flops on inputs ``x`` as the model's matrix multiplies count them."""
        ...

    @property
    def spike_skip(self) -> SpikeSkip | None:
        """The train step's ``skip_spikes`` (its skips are reported, and a long run of them stops ``fit``)."""
        ...

    def traced_values_changed(self) -> list[str]:
        """The plain trainer values a step of the user's own reads that changed since it was traced
        (``'beta: 1.0 -> 0.5'``): the compiled step would keep the old ones."""
        ...

    def decide_steps(self, steps: int, reason: str) -> None:
        """``steps_per_execution="auto"`` picked ``steps`` batches per call, for ``reason``."""
        ...

    def labels_message(self, count: int, value: int, where: str) -> str:
        """The error for ``count`` labels outside the classes (one of them ``value``) in ``where``."""
        ...


#: a hook's ``logs``: metric names to values (Keras's)
Logs = dict[str, Any]


class Hook:
    """One hook of every callback that implements it; ``active``: whether any does (the loop
    then builds its arguments); ``period`` (the train batch-end hook): the loop calls it only
    for the steps that cover a multiple of it (``None``: every batch). Each kind below has its
    hook's exact call."""

    active: bool = False
    period: int | None = None


class RunHook(Hook):
    """A hook about a whole run: ``on_train_begin(logs)``, ``on_test_end(logs)``, ..."""

    def __call__(self, logs: Logs | None = None) -> None:
        raise NotImplementedError


class IndexedHook(Hook):
    """A hook about one epoch or batch: ``on_epoch_begin(epoch, logs)``, ``on_train_batch_begin(batch, logs)``."""

    def __call__(self, index: int, logs: Logs | None = None) -> None:
        raise NotImplementedError


class BatchEndHook(Hook):
    """A batch-end hook; its ``logs`` may be a function that computes them (reading the device
    only when a callback reads them)."""

    def __call__(self, index: int, logs: Logs | Callable[[], Logs] | None = None) -> None:
        raise NotImplementedError


class ExceptionHook(Hook):
    """``on_exception(error)``: the error that ends the run."""

    def __call__(self, exception: BaseException) -> None:
        raise NotImplementedError


class Hooks(Protocol):
    """Keras's hooks, each called on the callbacks in order, and what the callbacks declare:
    ``async_<kind>`` (every batch-end hook of that kind is ``async_safe``: the loop may run
    ahead), the most steps one call may cover, whether one profiles steps, and whether one stops
    at a non-finite loss."""

    on_train_begin: RunHook
    on_train_end: RunHook
    on_epoch_begin: IndexedHook
    on_epoch_end: IndexedHook
    on_train_batch_begin: IndexedHook
    on_train_batch_end: BatchEndHook
    on_test_begin: RunHook
    on_test_end: RunHook
    on_test_batch_begin: IndexedHook
    on_test_batch_end: BatchEndHook
    on_predict_begin: RunHook
    on_predict_end: RunHook
    on_predict_batch_begin: IndexedHook
    on_predict_batch_end: BatchEndHook
    on_exception: ExceptionHook
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
    #: what the steps tuner measured in the trainer's earlier fits (a later fit decides from them)
    timings: Timings
    #: by measuring step: which step a fit with statistics calls between their due steps
    measuring: weakref.WeakKeyDictionary[Callable[..., Any], BetweenDue]

    def reader(
        self, dataset: Source, batches: Iterator[T], batch_size: int, read_ahead: bool = True
    ) -> Prefetcher[T]: ...

    def evaluate(
        self, dataset: Any, batch_size: int, steps: int | None, callbacks: Hooks, read_ahead: bool = True
    ) -> dict[str, float]: ...
