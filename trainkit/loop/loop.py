"""The loop: epochs and steps, the position, the steps in flight, callback dispatch, resume and
preemption. It runs compiled functions it is given and never compiles, places or saves anything.

What the loop needs is a typed :class:`~trainkit.loop.session.Session`: the ``state`` it
reads and replaces, ``function(kind)`` for the compiled ``"train"``, ``"eval"`` and
``"predict"`` steps (and ``"train_steps"``, ``k`` steps in one call, when its
``steps_per_execution`` is ``k > 1``), ``strategy`` (``put_batch``, ``put_batches``,
``fetch_rows``, ``real_rows``) and ``log_order``. Callbacks see the loop as ``self.trainer.loop``: its ``position``, the
:class:`StepRecord` of the batch a hook is about (``record``), and explicit calls:
``resume_at(position)``, ``request_stop()``, ``preempt()``.

>>> import numpy as np
>>> from trainkit.callbacks import CallbackList
>>> loop = Loop(session=None)
>>> loop.position, loop.stop_requested
(Position(epoch=0, batch=0, step=0), False)
>>> loop.resume_at(Position(epoch=2, batch=3, step=11)); loop.start
Position(epoch=2, batch=3, step=11)
>>> list(in_order(iter(range(5)), lag=2))
[0, 1, 2, 3, 4]
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import statistics
import time
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from trainkit import data as data_lib
from trainkit import distributed
from trainkit.core import totals as metrics_lib
from trainkit.core.state import abstract
from trainkit.core.step import batches_at
from trainkit.core.totals import SKIPPED_WARNING, EpochTotals, PackedTotals, pack
from trainkit.data.prefetch import Prefetcher
from trainkit.data.spans import executions, room_until
from trainkit.distributed.watchdog import StallWatchdog
from trainkit.loop.session import FitConfig, Session, Validation
from trainkit.loop.tuning import StepsTuner

_NO_TRACE = contextlib.nullcontext()  # no profiler annotation: nothing built per step
logger = logging.getLogger("trainkit")

PyTree = Any

#: Exit status of a run stopped by SIGTERM (preemption) after writing its backup: 128 + SIGTERM.
PREEMPTED_EXIT_CODE = 143


class Preempted(SystemExit):
    """Raised by ``fit`` after a preemption request (SIGTERM under ``BackupAndRestore``) once
    ``on_train_end`` ran and the backup is on disk. A ``SystemExit`` with status 143: uncaught,
    the process exits quietly with the status job schedulers expect; running the same command
    again resumes."""

    def __init__(self, step: int):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step

    def __str__(self) -> str:
        return f"training preempted after step {self.step}; run the same command again to resume"


class Position(NamedTuple):
    """Where training stands: the next batch to train (``epoch``, ``batch`` inside it) and the
    optimizer steps applied so far (``step``)."""

    epoch: int = 0
    batch: int = 0
    step: int = 0

    def rebatched(self, saved_batch_size: int | None, batch_size: int | None) -> Position:
        """The same number of examples seen, in batches of ``batch_size`` instead of
        ``saved_batch_size`` (unchanged when either is unknown)."""
        if not saved_batch_size or not batch_size or saved_batch_size == batch_size:
            return self
        return self._replace(batch=self.batch * saved_batch_size // batch_size)


class StepRecord(NamedTuple):
    """The batch a hook is about: ``step`` is its optimizer step counted from 1 (the number of
    updates once it is applied), ``epoch`` and ``batch`` where it sits. With
    ``steps_per_execution`` a hook is about one execution: ``steps`` batches, trained in one
    call, that end at ``step`` and ``batch`` (``first_step`` and ``first_batch`` begin it).

    >>> record = StepRecord(step=8, epoch=0, batch=7, steps=4)
    >>> record.first_step, record.first_batch, record.covers_multiple(6), record.covers_multiple(3)
    (5, 4, True, True)
    """

    step: int
    epoch: int
    batch: int
    steps: int = 1

    @property
    def first_step(self) -> int:
        return self.step - self.steps + 1

    @property
    def first_batch(self) -> int:
        return self.batch - self.steps + 1

    def covers_multiple(self, every: int) -> bool:
        """Whether one of the steps it covers is a multiple of ``every`` (a periodic action)."""
        return self.step // every > (self.first_step - 1) // every


def in_order(dispatched: Iterator, lag: int) -> Iterator:
    """Yields ``dispatched``'s items in order, each once ``lag`` newer ones were dispatched
    (``lag=0``: at once). The device results of a yielded item are then read while ``lag``
    steps still run: the device never waits for the host, and the queue stays bounded."""
    pending: collections.deque = collections.deque()
    for item in dispatched:
        pending.append(item)
        if len(pending) > lag:
            yield pending.popleft()
    yield from pending


def host_metrics(totals: PackedTotals) -> EpochTotals:
    """Device totals (packed) -> host float64 totals (gathered across processes when needed). On
    one process each array is read directly, where ``jax.device_get``'s overhead would be a fifth
    of a small model's step."""
    if jax.process_count() > 1:
        host = distributed.fetch(totals)
    else:
        host = totals.replace(arrays=tuple(np.asarray(a) for a in totals.arrays))
    return jax.tree.map(np.float64, host.unpack())


def process_slice() -> dict:
    """Which part of every global batch this process reads (all of it on one process)."""
    return {"process_index": jax.process_index(), "process_count": jax.process_count()}


class Loop:
    """Runs ``fit``, ``evaluate`` and ``predict`` of a session; see the module docstring.

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

    def __init__(self, session: Session):
        self.session = session
        self.position = Position()
        self.record: StepRecord | None = None
        self.batch_size: int | None = None
        self.stop_requested = False
        self.preempted = False
        self.start: Position | None = None
        self.batch_spec: PyTree = None  # shapes and shardings of this fit's batches
        self.data_state: Any = None  # the data iterator's position after the last batch trained
        self.resume_state: Any = None  # this process's saved iterator position to continue from
        self.validating_at: int | None = None  # the step of a validation every N steps, while it runs
        self.validation_logs: dict[str, float] = {}  # the latest one's
        self.interval_validation: tuple[Validation, int] | None = None  # (validation, every N steps) of this fit
        self.logged_names: tuple[str, ...] | None = None  # what this fit's epoch logs hold (set before on_train_begin)
        self._carry: PackedTotals | None = None  # the totals the last batch-end hook was given
        self._epoch_start = (0, 0)  # the step and batch this epoch's totals count from

    # ------------------------------------------------------------------ explicit requests
    def request_stop(self) -> None:
        """Stop before the next batch (``trainer.stop_training = True`` calls this)."""
        self.stop_requested = True

    def preempt(self) -> None:
        """Stop before the next batch, run ``on_train_end``, then raise :class:`Preempted`.
        Safe to call from a signal handler."""
        self.preempted = True
        self.stop_requested = True

    def resume_at(
        self, position: Position, saved_batch_size: int | None = None, data_state: list | None = None
    ) -> None:
        """Start this ``fit`` at ``position`` instead of ``initial_epoch`` (call it from
        ``on_train_begin``); a batch index written with another batch size is converted by
        examples seen. ``data_state``: the data iterators' saved positions, one per process
        (a checkpointable iterator continues from it instead of skipping batches)."""
        self.start = position.rebatched(saved_batch_size, self.batch_size)
        self.position = self.position._replace(step=position.step)
        self.resume_state = self.data_state = None
        if data_state is None:
            return
        if len(data_state) != jax.process_count() or self.start != position:
            warnings.warn(
                f"The data iterator's saved position was written by {len(data_state)} process(es) with batch size "
                f"{saved_batch_size}; this run has {jax.process_count()} with {self.batch_size}. The iterator restarts "
                "and skips the batches already trained instead.",
                stacklevel=3,
            )
            return
        self.resume_state = self.data_state = data_state[jax.process_index()]

    def restored(self, step: int) -> None:
        """The state was replaced by one at optimizer step ``step`` (a restore)."""
        self.position = self.position._replace(step=int(step))

    def memento(self) -> dict:
        """What a ``fit`` changes on the loop (its position, iterator state, last record, flags),
        to put back with :meth:`restore` after a trial ``fit`` (``find_learning_rate``)."""
        return dict(vars(self))

    def restore(self, memento: dict) -> None:
        vars(self).clear()
        vars(self).update(memento)

    def _done(self, max_steps: int | None) -> bool:
        return self.stop_requested or (max_steps is not None and self.position.step >= max_steps)

    # ------------------------------------------------------------------ fit
    def fit(self, dataset: data_lib.Source, batch_size: int, callbacks: Any, config: FitConfig) -> dict[str, float]:
        """Trains from ``config.initial_epoch`` (or where a callback's ``resume_at`` says) to
        ``config.epochs`` and returns the last epoch's logs. Hooks follow Keras 3's ``fit``
        order. With ``config.validation_interval`` the validation runs after every that many
        optimizer steps (on the state of that step) and the epoch logs carry the latest."""
        epochs, steps, max_steps = config.epochs, config.steps, config.max_steps
        self.epoch_steps = steps
        validation = config.validation
        names = list(self.session.log_order)  # what the epoch logs will hold (Keras 2's params["metrics"])
        self.logged_names = tuple(names + ([f"val_{name}" for name in names] if validation else []))
        # TerminateOnNaN watches the loss itself: no warning of the loop's then
        warn_non_finite = config.warn_non_finite and not callbacks.stops_on_non_finite
        validation_interval = config.validation_interval
        self.stop_requested = self.preempted = False
        self.skipped_in_a_row = 0
        self.batch_size, self.start, self.batch_spec = batch_size, None, None
        self.data_state = self.resume_state = None
        self.validation_logs = {}
        self.interval_validation = (validation, validation_interval) if validation_interval else None
        self.position = Position(config.initial_epoch, 0, self.position.step)
        train_fn = self.session.function("train")
        logger.info("fit: %s, batch_size=%d, %s steps/epoch", self.session.strategy.describe(), batch_size, steps)
        read_ahead = not dataset.one_shot
        logs: dict[str, float] = {}
        self.watchdog = StallWatchdog()
        try:
            self.watchdog.__enter__()
            callbacks.on_train_begin()
            start = self.start or self.position
            for epoch in range(start.epoch, epochs):
                first = start.batch if epoch == start.epoch else 0
                self.position = Position(epoch, first, self.position.step)
                callbacks.on_epoch_begin(epoch)
                batches = data_lib.epoch_batches(
                    dataset,
                    batch_size,
                    epoch,
                    first,
                    steps,
                    continuing=config.continuing,
                    shuffle=config.shuffle,
                    seed=config.seed,
                    state=self.resume_state if epoch == start.epoch else None,
                    **process_slice(),
                )
                if max_steps is not None:  # nothing read past the last step
                    batches = itertools.islice(batches, max(max_steps - self.position.step, 0))
                with self._train_reader(dataset, batches, max_steps) as reader:
                    ran, logs = self._train_epoch(train_fn, reader, callbacks, max_steps, warn_non_finite, read_ahead)
                if self.preempted:
                    break
                if ran == 0 and first == 0:
                    warnings.warn(
                        f"The data ran out at epoch {epoch}: no batch was left. Training stops; "
                        "pass steps_per_epoch that the data can serve, or a re-iterable dataset.",
                        stacklevel=3,
                    )
                    break
                if self.interval_validation is not None:
                    logs.update(self.validation_logs)
                elif validation is not None and config.validates(epoch):
                    val_logs = self.evaluate(*validation, callbacks)
                    logs.update({f"val_{k}": v for k, v in val_logs.items()})
                self.position = Position(epoch + 1, 0, self.position.step)
                callbacks.on_epoch_end(epoch, logs)
                if self._done(max_steps):
                    break
            callbacks.on_train_end(logs)
        except BaseException as error:
            callbacks.on_exception(error)
            raise
        finally:
            self.watchdog.__exit__()
        if self.preempted:
            raise Preempted(self.position.step)
        return logs

    def _reader(self, dataset: data_lib.Source, batches: Iterator, batch_size: int) -> Prefetcher:
        """``batches`` assembled ahead in a background thread; in this thread, one batch at a
        time, when that is quicker (small in-memory batches) and for a one-shot iterator (a
        batch assembled ahead would be lost at a stop; its source reads its elements ahead
        itself and hands back what a stop leaves)."""
        here = dataset.one_shot or dataset.assembles_quickly(batch_size)
        return Prefetcher(batches, depth=0 if here else self.prefetch)

    def _train_reader(self, dataset: data_lib.Source, batches: Iterator, max_steps: int | None) -> Prefetcher:
        """The epoch's :class:`~trainkit.data.spans.Span` s, assembled ahead like :meth:`_reader`'s
        batches; the data position is read in the same thread, right after each batch."""
        if dataset.checkpointable:
            pairs = ((batch, dataset.get_state()) for batch in batches)
        else:
            pairs = zip(batches, itertools.repeat(None))
        every = self.interval_validation[1] if self.interval_validation else None
        size = lambda: self.session.steps_per_execution  # noqa: E731 - "auto" may change it mid-epoch
        spans = executions(pairs, size, room_until(self.position.step, max_steps, every))
        return self._reader(dataset, spans, self.batch_size)

    def _train_epoch(
        self, train_fn, batches: Iterable, callbacks, max_steps, warn_non_finite, read_ahead
    ) -> tuple[int, dict]:
        """One epoch's steps. Each compiled call merges its metrics into the epoch's totals on
        the device (:class:`~trainkit.core.totals.EpochTotals`); the host reads them at the end,
        and for a batch-end hook only when a
        callback reads its logs then (the progress bar: on a clock)."""
        session, epoch = self.session, self.position.epoch
        batch_begin, batch_end, order = callbacks.on_train_batch_begin, callbacks.on_train_batch_end, session.log_order
        annotate = self.annotate_steps or callbacks.annotates_steps
        items = iter(batches)
        tuner = self._tuner(callbacks, max_steps)
        start_step, start_batch = self.position.step, self.position.batch
        self._epoch_start, self._carry = (start_step, start_batch), None
        totals, first_host = None, None  # the epoch's totals on the device, shaped by its first batch

        def place(item):
            """A span of host batches on the devices: one stacked batch (``fused``) or a list."""
            nonlocal first_host
            if item is None:
                return None
            strategy, batches = session.strategy, item.batches
            placed = strategy.put_batches(batches) if item.fused else [strategy.put_batch(b) for b in batches]
            if first_host is None:  # the first span's first host batch shapes the epoch's totals
                first_host = batches_at(batches, 0) if item.fused else batches[0]
            if self.batch_spec is None:  # one batch's shapes and shardings, for lowering
                self.batch_spec = abstract(strategy.put_batch(batches_at(batches, 0)) if item.fused else placed[0])
            return item._replace(batches=placed)

        def read():
            """The next placed batch; an error of the data is kept (noted with where it
            happened) and raised only after the batch before it went through its hooks."""
            try:
                return place(next(items, None))
            except Exception as error:  # noqa: BLE001 - the loader's own error, re-raised as it is
                error.add_note(
                    f"trainkit: raised by the data while reading batch {self.position.batch} of epoch {epoch}; the "
                    f"trainer's state is that of step {self.position.step}, the last one run, and is intact."
                )
                return error

        def dispatch():
            nonlocal totals
            upcoming = read()
            while upcoming is not None:
                if isinstance(upcoming, Exception):
                    raise upcoming
                placed, fused, steps, data_state = upcoming  # a Span of placed batches
                if totals is None:
                    empty = session.empty_totals("train", first_host)
                    totals = session.strategy.put_replicated(pack(empty.continuing(self.skipped_in_a_row)))
                done = self.position.step
                record = StepRecord(done + steps, epoch, self.position.batch + steps - 1, steps)
                if batch_begin.active:
                    self.record = record
                    batch_begin(record.first_batch)
                if fused:
                    steps_fn = session.function("train_steps")
                    with jax.profiler.StepTraceAnnotation("train", step_num=record.step) if annotate else _NO_TRACE:
                        session.state, totals = steps_fn(session.state, totals, placed)
                elif tuner is not None and tuner.steps is None:
                    for batch in placed:
                        totals = self._timed_step(train_fn, totals, batch, tuner)
                else:
                    for number, batch in enumerate(placed, start=done + 1):
                        with jax.profiler.StepTraceAnnotation("train", step_num=number) if annotate else _NO_TRACE:
                            session.state, totals = train_fn(session.state, totals, batch)
                self.watchdog.progress(record.step)
                self.position, self.data_state = Position(epoch, record.batch + 1, record.step), data_state
                if self.interval_validation is not None:
                    self._validate_every(record.step, callbacks)
                # The host reads and places the next batch while the device runs this one; its
                # step is dispatched only after this batch's hooks ran. A one-shot iterator is
                # not read ahead: a stop would lose the batch read.
                upcoming = read() if read_ahead else None
                yield record, totals
                if self._done(max_steps):
                    return
                if not read_ahead:
                    upcoming = read()

        ran, last = 0, None
        lag = self.max_in_flight if callbacks.async_train else 0
        for record, carry in in_order(dispatch(), lag):
            carry.block_until_ready()  # at most `lag` executions queued behind this one
            ran, last = ran + record.steps, carry
            if batch_end.active:
                self.record, self._carry = record, carry
                batch_end(record.batch, lambda carry=carry: metrics_lib.compute(host_metrics(carry).metrics, order))
        if last is None:
            return 0, {}
        host = host_metrics(last)
        self._watch(host, start_step, start_batch, epoch, warn_non_finite)
        return ran, metrics_lib.compute(host.metrics, order)

    def _tuner(self, callbacks, max_steps: int | None) -> StepsTuner | None:
        """Under ``steps_per_execution="auto"`` (not decided yet), a tuner capped by the epoch,
        the validation interval, ``max_steps`` and the callbacks' periods."""
        session = self.session
        if not session.tunes_steps or not session.strategy.fuses_steps:
            return None
        caps = [self.epoch_steps, callbacks.execution_cap, max_steps]
        caps += [self.interval_validation[1]] if self.interval_validation else []
        self._last_ready = None
        return StepsTuner(min((c for c in caps if c is not None), default=None))

    def _timed_step(self, train_fn, totals, batch, tuner: StepsTuner):
        """One step run synchronously and timed for the tuner (the first call of a fit is not
        timed: it may compile); once it decided, the session trains that many steps per call."""
        session = self.session
        session.state, totals = train_fn(session.state, totals, batch)
        back = time.perf_counter()
        totals.block_until_ready()
        ready = time.perf_counter()
        if self._last_ready is not None:
            tuner.record(host=back - self._last_ready, device=ready - back)
        self._last_ready = ready
        if tuner.steps is not None:
            steps = distributed.broadcast_int(tuner.steps)  # timings differ per process: process 0 decides
            session.steps_per_execution, session.tunes_steps = steps, False
            reason = (
                f"picked {steps}: {1e6 * statistics.median(tuner.hosts):.0f} us of host time per call, "
                f"{1e6 * statistics.median(tuner.devices):.0f} us of device time per step"
            )
            session.report_steps(steps, reason)
            logger.info("steps_per_execution='auto' %s", reason)
        return totals

    def first_non_finite(self) -> tuple[int, int, float] | None:
        """For a batch-end hook: the optimizer step (from 1) and the batch of this epoch whose
        loss was first not finite, and that loss, or ``None`` while every loss is finite. With
        ``steps_per_execution`` the hook's batch is the execution's last; this is the one that
        went wrong. Reads the device totals (call it after seeing a non-finite loss)."""
        if self._carry is None:
            return None
        start_step, start_batch = self._epoch_start
        host = host_metrics(self._carry)
        bad = int(host.first_non_finite)
        return (start_step + bad, start_batch + bad - 1, float(host.first_non_finite_loss)) if bad else None

    def _watch(self, totals: EpochTotals, start_step: int, start_batch: int, epoch: int, warn_non_finite: bool) -> None:
        """The epoch's warnings, from its totals: the first non-finite loss (unless a callback
        stops at it), and (once per run) ``SKIPPED_WARNING`` steps in a row skipped by the
        fp16 loss scale: the model is then not training at all."""
        bad = int(totals.first_non_finite)
        if warn_non_finite and bad:
            warnings.warn(
                f"The loss is {float(totals.first_non_finite_loss)} at step {start_step + bad} (batch "
                f"{start_batch + bad - 1} of epoch {epoch}); training goes on. Add "
                "tk.callbacks.TerminateOnNaN() to stop at the first non-finite loss.",
                stacklevel=4,
            )
        if totals.skipped_run is None:  # no loss scale: no step is skipped
            return
        self.skipped_in_a_row = int(totals.skipped_run)
        alarm = int(totals.skipped_alarm)
        if alarm:
            warnings.warn(
                f"The last {SKIPPED_WARNING} steps (up to step {start_step + alarm}) were all skipped: their "
                f"gradients were not finite at every loss scale down to {float(totals.skipped_scale):g}, so the "
                "parameters did not change. The loss or the model overflows in fp16: use precision='bf16', lower "
                "the learning rate, or look for a NaN in the data.",
                stacklevel=4,
            )

    def _validate_every(self, step: int, callbacks) -> None:
        """``validation_interval``: after every N-th step is dispatched, validate on its state."""
        if self.interval_validation is None or step % self.interval_validation[1]:
            return
        self.validating_at = step
        try:
            val_logs = self.evaluate(*self.interval_validation[0], callbacks)
        finally:
            self.validating_at = None
        self.validation_logs = {f"val_{k}": v for k, v in val_logs.items()}

    # ------------------------------------------------------------------ evaluate / predict
    def _inference(self, kind: str, dataset: Any, batch_size: int, steps: int | None, callbacks) -> Iterator:
        """``(first, last, host batches, results)`` per span of ``steps_per_execution`` batches
        (one call per batch), in order, with the span's batch-begin hook of ``kind``
        (``"test"`` / ``"predict"``), as Keras runs them. ``results``: for ``"test"`` the totals
        after the span (the eval step merges each batch's metrics into them on the device),
        for ``"predict"`` each batch's outputs."""
        session = self.session
        fn = session.function("eval" if kind == "test" else "predict")
        batch_begin = callbacks.on_test_batch_begin if kind == "test" else callbacks.on_predict_batch_begin
        size = session.steps_per_execution

        def dispatch():
            host_batches = itertools.islice(dataset.batches(batch_size, split=True, **process_slice()), steps)
            totals = None
            with self._reader(dataset, host_batches, batch_size) as reader:
                index = 0
                while True:
                    span = []
                    try:
                        span.extend(itertools.islice(reader, size))
                    except Exception as error:  # the loader's own error, noted with where it happened
                        error.add_note(f"trainkit: raised by the data while reading batch {index} for {kind}.")
                        raise
                    if not span:
                        return
                    if batch_begin.active:
                        batch_begin(index)
                    strategy, state = session.strategy, session.state
                    if kind == "predict":
                        results = [fn(state, strategy.put_batch(host)) for host in span]
                    else:
                        if totals is None:
                            totals = strategy.put_replicated(pack(session.empty_totals("eval", span[0])))
                        for host in span:
                            totals = fn(state, totals, strategy.put_batch(host))
                        results = totals
                    yield index, index + len(span) - 1, span, results
                    index += len(span)

        runs_ahead = callbacks.async_test if kind == "test" else callbacks.async_predict
        return in_order(dispatch(), self.max_in_flight if runs_ahead else 0)

    def evaluate(self, dataset: Any, batch_size: int, steps: int | None, callbacks) -> dict[str, float]:
        """The loss and metrics over ``dataset`` (exact: masked totals over every real row)."""
        callbacks.on_test_begin()
        order, totals, batch_end = self.session.log_order, None, callbacks.on_test_batch_end
        for _, last, _, totals in self._inference("test", dataset, batch_size, steps, callbacks):
            totals.block_until_ready()  # a bounded queue of dispatched batches
            if batch_end.active:
                batch_end(last, lambda totals=totals: metrics_lib.compute(host_metrics(totals).metrics, order))
        logs = {} if totals is None else metrics_lib.compute(host_metrics(totals).metrics, order)
        callbacks.on_test_end(logs)
        return logs

    def predict(self, dataset: Any, batch_size: int, steps: int | None, callbacks) -> PyTree:
        """The model's outputs, one row per real input row (padding removed)."""
        strategy = self.session.strategy
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


def concatenate(parts: list[PyTree]) -> PyTree:
    """Row blocks of one structure joined along the rows."""
    return jax.tree.map(lambda *a: np.concatenate(a), *parts)
