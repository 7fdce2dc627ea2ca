"""The loop: ``fit``, ``evaluate`` and ``predict`` over the compiled steps it is given. It runs
them and never compiles, places or saves anything, and it holds no run's state: the live
``TrainState``, the position, the data state and the stop flag are the trainer's
:class:`~trainkit.record.session.Session`'s, and one ``fit``'s own values live in its
:class:`~trainkit.loop.fit_run.FitRun`. What the loop keeps are its settings (``prefetch``,
``annotate_steps``, ``max_in_flight``).

>>> import trainkit as tk, numpy as np, optax, flax.linen as nn
>>> trainer = tk.Trainer(nn.Dense(1), loss="mse", optimizer=optax.sgd(0.1), strategy="single")
>>> trainer.loop.prefetch, type(trainer.loop.session).__name__
(8, 'Session')
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax

from trainkit import data as data_lib
from trainkit.core import checks
from trainkit.core import totals as metrics_lib
from trainkit.core.totals import pack
from trainkit.core.tree import PyTree
from trainkit.data.prefetch import Prefetcher
from trainkit.loop.dispatch import concatenate, host_metrics, in_order, logs_of, this_process
from trainkit.loop.fit_run import FitRun
from trainkit.loop.hooks import CompiledSteps, Hooks
from trainkit.loop.measuring import BetweenDue
from trainkit.loop.tuning import Timings
from trainkit.record.session import Session

T = TypeVar("T")
#: One span of evaluate / predict: its first and last batch, the host batches and the results.
Inferred = tuple[int, int, list[PyTree], PyTree]


class Loop:
    """Runs ``fit``, ``evaluate`` and ``predict`` of a trainer's compiled steps on its session.

    ``max_in_flight`` bounds the steps dispatched ahead of the oldest one whose metrics were
    not read yet, when every batch-level callback is ``async_safe`` (otherwise each batch's
    hooks run before the next batch is dispatched, as Keras does). Too many queued collectives
    deadlock XLA's CPU all-reduce on fake devices, so it stays small.
    """

    max_in_flight: int = 2
    #: Mark every step for a profile (``jax.profiler.StepTraceAnnotation``); on by itself while a
    #: callback that profiles (``tk.callbacks.Profiler``) runs. Set it under your own trace.
    annotate_steps: bool = False
    #: Host batches assembled ahead in a background thread (0: read in the main thread).
    prefetch: int = 8

    def __init__(self, session: Session, steps: CompiledSteps):
        self.session, self.steps = session, steps
        self.timings = Timings()  # what the steps tuner measured in this trainer's fits
        #: by measuring step (GradientStats): whether the steps between due ones still call it (weak:
        #: a step the setup dropped, and its executable, are not kept alive here)
        self.measuring: weakref.WeakKeyDictionary[Callable[..., Any], BetweenDue] = weakref.WeakKeyDictionary()

    def fit(
        self, dataset: data_lib.Source, batch_size: int, callbacks: Hooks, config: data_lib.FitConfig
    ) -> dict[str, float]:
        """Trains from ``config.initial_epoch`` (or where a callback's ``resume_at`` says) to
        ``config.epochs`` and returns the last epoch's logs (see :class:`~trainkit.loop.fit_run.FitRun`)."""
        with self.out_of_memory_named("train"):
            return FitRun(self, dataset, batch_size, callbacks, config).run()

    @contextlib.contextmanager
    def out_of_memory_named(self, kind: str) -> Iterator[None]:
        """A device's out-of-memory error raised by a ``kind`` run re-raised as trainkit's named
        :class:`~trainkit.program.out_of_memory.OutOfMemory` (the device's as its cause)."""
        try:
            yield
        except (MemoryError, RuntimeError) as error:
            named = self.steps.out_of_memory(kind, error) if checks.out_of_memory(error) else error
            if named is error:
                raise
            raise named from error

    def reader(
        self, dataset: data_lib.Source, batches: Iterator[T], batch_size: int, read_ahead: bool = True
    ) -> Prefetcher[T]:
        """``batches`` assembled ahead in a background thread; in this thread, one batch at a
        time, when that is quicker (small in-memory batches), for a one-shot iterator (a
        batch assembled ahead would be lost at a stop; its source reads its elements ahead
        itself and hands back what a stop leaves), and without ``read_ahead``."""
        here = not read_ahead or dataset.one_shot or dataset.assembles_quickly(batch_size)
        return Prefetcher(batches, depth=0 if here else self.prefetch)

    # ------------------------------------------------------------------ evaluate / predict
    def _inference(
        self,
        kind: str,
        dataset: data_lib.Source,
        batch_size: int,
        steps: int | None,
        callbacks: Hooks,
        read_ahead: bool = True,
    ) -> Iterator[Inferred]:
        """``(first, last, host batches, results)`` per span of ``steps_per_execution`` batches
        (one call per batch), in order, with the span's batch-begin hook of ``kind``
        (``"test"`` / ``"predict"``), as Keras runs them. ``results``: for ``"test"`` the totals
        after the span (the eval step merges each batch's metrics into them on the device),
        for ``"predict"`` each batch's outputs."""
        compiled, session = self.steps, self.session
        fn = compiled.function("eval" if kind == "test" else "predict")
        batch_begin = callbacks.on_test_batch_begin if kind == "test" else callbacks.on_predict_batch_begin
        size, strategy = compiled.steps_per_execution, compiled.require_strategy()

        def dispatch() -> Iterator[Inferred]:
            batches = dataset.batches(
                batch_size,
                this_process(data_lib.BatchRequest(split=True, read_ahead=read_ahead), strategy.batch_share()),
            )
            host_batches = itertools.islice(batches, steps)
            totals = None
            with self.reader(dataset, host_batches, batch_size, read_ahead) as reader:
                index = 0
                while True:
                    span: list[PyTree] = []
                    try:
                        span.extend(itertools.islice(reader, size))
                    except Exception as error:  # the loader's own error, noted with where it happened
                        error.add_note(f"trainkit: raised by the data while reading batch {index} for {kind}.")
                        raise
                    if not span:
                        return
                    if batch_begin.active:
                        batch_begin(index)
                    state = session.state
                    if kind == "predict":
                        results = [fn(state, strategy.put_batch(host)) for host in span]
                    else:
                        if totals is None:
                            totals = strategy.put_replicated(pack(compiled.empty_totals("eval", span[0])))
                        for host in span:
                            totals = fn(state, totals, strategy.put_batch(host))
                        results = totals
                    yield index, index + len(span) - 1, span, results
                    index += len(span)

        runs_ahead = callbacks.async_test if kind == "test" else callbacks.async_predict
        return in_order(dispatch(), self.max_in_flight if runs_ahead else 0)

    def evaluate(
        self, dataset: data_lib.Source, batch_size: int, steps: int | None, callbacks: Hooks, read_ahead: bool = True
    ) -> dict[str, float]:
        """The loss and metrics over ``dataset`` (exact: masked totals over every real row)."""
        with self.out_of_memory_named("eval"):
            return self._evaluate(dataset, batch_size, steps, callbacks, read_ahead)

    def _evaluate(
        self, dataset: data_lib.Source, batch_size: int, steps: int | None, callbacks: Hooks, read_ahead: bool
    ) -> dict[str, float]:
        callbacks.on_test_begin()
        order, totals, batch_end = self.steps.log_order, None, callbacks.on_test_batch_end
        for _, last, _, totals in self._inference("test", dataset, batch_size, steps, callbacks, read_ahead):
            totals.block_until_ready()  # a bounded queue of dispatched batches
            if batch_end.active:
                batch_end(last, functools.partial(logs_of, totals, order))
        logs = {} if totals is None else metrics_lib.compute(host_metrics(totals).metrics, order)
        callbacks.on_test_end(logs)
        return logs

    def predict(self, dataset: data_lib.Source, batch_size: int, steps: int | None, callbacks: Hooks) -> PyTree:
        """The model's outputs, one row per real input row (padding removed)."""
        with self.out_of_memory_named("predict"):
            return self._predict(dataset, batch_size, steps, callbacks)

    def _predict(self, dataset: data_lib.Source, batch_size: int, steps: int | None, callbacks: Hooks) -> PyTree:
        strategy = self.steps.require_strategy()
        callbacks.on_predict_begin()
        parts = []
        for _, last, host_batches, results in self._inference("predict", dataset, batch_size, steps, callbacks):
            span = []
            for host_batch, outputs in zip(host_batches, results):
                rows = strategy.real_rows(host_batch["mask"])
                span.append(jax.tree.map(lambda a, n=rows: a[:n], strategy.fetch_rows(outputs)))
            parts.extend(span)
            if callbacks.on_predict_batch_end.active:
                callbacks.on_predict_batch_end(last, {"outputs": concatenate(span)})
        callbacks.on_predict_end()
        return concatenate(parts)
