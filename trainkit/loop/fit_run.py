"""``FitRun``: one ``fit``, its epochs and steps, and the values that live exactly as long as it
does (the validation logs of a ``validation_interval``, the steps skipped in a row by the fp16
loss scale, the stall watchdog, the ``steps_per_execution="auto"`` tuner, the state as its steps
carry it). The loop makes one per ``fit`` and drops it after; what outlives a ``fit`` (the state,
the position, the data state, the flags) is the session's, changed only through its methods.

>>> import trainkit as tk, numpy as np, optax, flax.linen as nn
>>> trainer = tk.Trainer(nn.Dense(1), loss="mse", optimizer=optax.sgd(0.1), strategy="single")
>>> history = trainer.fit((np.ones((8, 2), np.float32), np.ones((8, 1), np.float32)), batch_size=4, verbose=0)
>>> trainer.session.position, trainer.session.batch_size   # the run's state is the session's
(Position(epoch=1, batch=0, step=2), 4)
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import statistics
import time
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import jax

from trainkit import data as data_lib
from trainkit import distributed
from trainkit.core import spikes as spikes_lib
from trainkit.core import totals as metrics_lib
from trainkit.core.spikes import SPIKES
from trainkit.core.state import abstract
from trainkit.core.step import batches_at
from trainkit.core.totals import GRAD_NORM, LABEL_ALARM, SKIPPED_WARNING, EpochTotals, PackedTotals, pack
from trainkit.core.tree import JSON, PyTree, TreeFunction
from trainkit.core.warn import warn_user
from trainkit.data.prefetch import Prefetcher
from trainkit.data.source import BatchRequest
from trainkit.data.spans import AS_READ, Assembly, IndexedSpan, Rows, Span, executions, room_until
from trainkit.distributed.watchdog import StallWatchdog
from trainkit.loop.carried import CarriedState
from trainkit.loop.dispatch import Preempted, host_metrics, in_order, logs_of, this_process
from trainkit.loop.hooks import Hooks, LoopView
from trainkit.loop.measuring import BetweenDue, SetAside
from trainkit.loop.tuning import FusedCheck, StepsTuner, prior_compile_factor
from trainkit.record.ledger import Bucket, ProcessLedger
from trainkit.record.session import FitView, Position, StepRecord

_NO_TRACE = contextlib.nullcontext()  # no profiler annotation: nothing built per step
#: how often a running epoch's totals are read for a run of skipped spikes (``skip_spikes``)
SPIKE_CHECK_SECONDS = 1.0
logger = logging.getLogger("trainkit")


class FitRun:
    """The ``fit`` of ``dataset`` in batches of ``batch_size`` under ``config`` on ``loop``'s
    session and compiled steps (see the module docstring); :meth:`run` trains it. Hooks follow
    Keras 3's ``fit`` order. With ``config.validation_interval`` the validation runs after every
    that many optimizer steps (on the state of that step) and the epoch logs carry the latest."""

    def __init__(
        self, loop: LoopView, dataset: data_lib.Source, batch_size: int, callbacks: Hooks, config: data_lib.FitConfig
    ):
        self.loop, self.session, self.steps = loop, loop.session, loop.steps
        self.dataset, self.batch_size, self.callbacks, self.config = dataset, batch_size, callbacks, config
        self.strategy = loop.steps.require_strategy()
        self.every = config.validation_interval if config.validation is not None else None
        self.validation_logs: dict[str, float] = {}  # the latest validation every N steps
        self.skipped_in_a_row = 0  # steps skipped by the fp16 loss scale, carried across epochs
        # TerminateOnNaN watches the loss itself: no warning of the loop's then
        self.warn_non_finite = config.warn_non_finite and not callbacks.stops_on_non_finite
        self.read_ahead = not dataset.one_shot  # a one-shot iterator's next batch is read only when it is due
        self.watchdog = StallWatchdog()
        self.carried = CarriedState(self.session)  # the state as this fit's steps carry it
        self.tuner: StepsTuner | None = None
        self.last_ready: float | None = None
        self.unfused = False  # the default setting found fusing not worth it in this fit: no more probes
        self.fused_check: FusedCheck | None = None  # the default's fused calls timed against one step per call
        self.between_due = self.measuring_plan()  # GradientStats: which step the steps between due ones call
        self._table: PyTree = None  # data_on_device: every row on the devices, placed at the first fused call

    def table(self) -> PyTree:
        """``data_on_device``: the data's rows on every device, placed once per ``fit``."""
        if self._table is None:
            self._table = self.strategy.put_table(self.dataset.table())
        return self._table

    def measuring_plan(self) -> BetweenDue | None:
        """The loop's :class:`~trainkit.loop.measuring.BetweenDue` of this fit's measuring step
        (``None``: no statistics), kept across the trainer's fits."""
        every = self.steps.measured_every
        if every is None:
            return None
        return self.loop.measuring.setdefault(self.steps.function("train_measured"), BetweenDue(every))

    def run(self) -> dict[str, float]:
        """Trains from ``config.initial_epoch`` (or where a callback's ``resume_at`` says) to
        ``config.epochs`` and returns the last epoch's logs."""
        session, config, callbacks = self.session, self.config, self.callbacks
        names = list(self.steps.log_order)  # what the epoch logs will hold (Keras 2's params["metrics"])
        logged = tuple(names + ([f"val_{name}" for name in names] if config.validation else []))
        session.begin_fit(FitView(self.batch_size, logged), Position(config.initial_epoch, 0, session.position.step))
        train_fn = self.steps.function("train")
        logger.info("fit: %s, batch_size=%d, %s steps/epoch", self.strategy.describe(), self.batch_size, config.steps)
        logs: dict[str, float] = {}
        session.ledger.switch(Bucket.STEP)  # the setup is done: from here the loop's own time is the steps'
        try:
            self.watchdog.__enter__()
            callbacks.on_train_begin()
            start = session.start or session.position
            for epoch in range(start.epoch, config.epoch_count):
                first = start.batch if epoch == start.epoch else 0
                session.moved(Position(epoch, first, session.position.step), session.data_state)
                callbacks.on_epoch_begin(epoch)
                ran, logs = self.epoch(train_fn, epoch, first, session.resume_state if epoch == start.epoch else None)
                if session.preempted:
                    break
                if ran == 0 and first == 0:
                    warn_user(
                        f"The data ran out at epoch {epoch}: no batch was left. Training stops; "
                        "pass steps_per_epoch that the data can serve, or a re-iterable dataset."
                    )
                    break
                if self.every is not None:
                    logs.update(self.validation_logs)
                elif config.validation is not None and config.validates(epoch):
                    with session.ledger.bucket(Bucket.VALIDATION):
                        val_logs = self.loop.evaluate(*config.validation, callbacks, read_ahead=config.read_ahead)
                    logs.update({f"val_{k}": v for k, v in val_logs.items()})
                session.moved(Position(epoch + 1, 0, session.position.step), session.data_state)
                callbacks.on_epoch_end(epoch, logs)
                refuse_changed_values(self.steps.traced_values_changed(), epoch)
                if self.done():
                    break
            self.close_ledger()
            callbacks.on_train_end(logs)
            session.ledger.amend()  # history.goodput covers on_train_end's hooks too
        except BaseException as error:
            session.ledger.settle()
            session.ledger.close()  # the failed fit's ledger, to the failure (this process's: no collective here)
            callbacks.on_exception(error)
            if isinstance(error, SystemExit) and not isinstance(error, Preempted):  # one process's sys.exit
                distributed.leave_now(error, "fit")  # several processes: this one ends now, its peers with it
            raise
        finally:
            self.watchdog.__exit__()
        if session.preempted:
            raise Preempted(session.position.step)
        return logs

    def close_ledger(self) -> None:
        """The goodput ledger of this ``fit`` closed before ``on_train_end`` (whose hooks read
        it: ``History.goodput``, the progress bar's table, the loggers); on several processes
        each one's buckets and step times gathered, and the stragglers named."""
        ledger = self.session.ledger
        ledger.settle()
        processes: tuple[ProcessLedger, ...] = ()
        if jax.process_count() > 1:
            mine = ledger.result(settle=False)
            row: list[Any] = [mine.buckets, mine.step_median, mine.step_p99]  # a dict and two numbers
            rows = distributed.gather_json(row)
            processes = tuple(ProcessLedger(i, *row) for i, row in enumerate(rows))
        ledger.close(processes)

    def done(self) -> bool:
        max_steps = self.config.max_steps
        return self.session.stop_requested or (max_steps is not None and self.session.position.step >= max_steps)

    def steps_left(self) -> int | None:
        """The steps before ``max_steps`` (``None``: no ``max_steps``)."""
        max_steps = self.config.max_steps
        return None if max_steps is None else max(max_steps - self.session.position.step, 0)

    def epoch(self, train_fn: TreeFunction, epoch: int, first: int, resume_state: JSON) -> tuple[int, dict[str, float]]:
        """One epoch from batch ``first`` (the data continuing from ``resume_state`` when it can):
        the batches trained and the epoch's logs."""
        config, ledger = self.config, self.session.ledger
        previous = ledger.switch(Bucket.INPUT)  # the epoch's order and its reader: the data's time
        this_epoch = None if config.steps is None else config.steps - first
        due = [n for n in (this_epoch, self.steps_left()) if n is not None]
        read_limit = max(min(due), 0) if due else None  # a generator is read ahead no further than this epoch
        batches: Iterator[PyTree | Rows] = data_lib.epoch_batches(
            self.dataset,
            self.batch_size,
            epoch,
            first,
            config.steps,
            continuing=config.continuing,
            request=this_process(
                BatchRequest(
                    shuffle=config.shuffle,
                    seed=config.seed,
                    state=resume_state,
                    read_ahead=config.read_ahead,
                    read_limit=read_limit,
                ),
                self.strategy.batch_share(),
            ),
            named_rows=self.dataset.gathers_rows,  # gathered when their span is: a fused call's in one piece
        )
        if config.max_steps is not None:  # nothing read past the last step
            batches = itertools.islice(batches, self.steps_left())
        reader = self.train_reader(batches)
        ledger.switch(previous)
        with reader:
            return self.train_epoch(train_fn, reader)

    def train_reader(self, batches: Iterator[PyTree | Rows]) -> Prefetcher[Span | None]:
        """The epoch's :class:`~trainkit.data.spans.Span` s, assembled ahead like the loop's
        reader assembles batches; the data position is read in the same thread, right after each batch."""
        dataset = self.dataset
        pairs: Iterator[tuple[PyTree | Rows, JSON]]
        if dataset.checkpointable:
            pairs = ((batch, dataset.get_state()) for batch in batches)
        else:
            pairs = zip(batches, itertools.repeat(None))
        size = lambda: self.steps.steps_per_execution  # noqa: E731 - "auto" may change it mid-epoch
        room = room_until(self.session.position.step, self.config.max_steps, self.every)
        assembly = AS_READ  # in-memory rows: a fused call's gathered in one piece, by the host or the devices
        if dataset.gathers_rows:
            stacked = dataset.indexed_stacked if self.config.data_on_device else dataset.gather_stacked
            assembly = Assembly(dataset.gather, stacked)
        spans = executions(pairs, size, room, assembly)
        return self.loop.reader(dataset, spans, self.batch_size, read_ahead=self.config.read_ahead)

    def train_epoch(self, train_fn: TreeFunction, batches: Iterable[Span | None]) -> tuple[int, dict[str, float]]:
        """One epoch's steps. Each compiled call merges its metrics into the epoch's totals on
        the device (:class:`~trainkit.core.totals.EpochTotals`); the host reads them at the end,
        and for a batch-end hook only when a callback reads its logs then (the progress bar: on a clock)."""
        session, batch_end, order = self.session, self.callbacks.on_train_batch_end, self.steps.log_order
        start = session.position
        session.epoch_began(start)
        self.tuner = self.make_tuner()
        ran, last = 0, None
        lag = self.loop.max_in_flight if self.callbacks.async_train else 0
        completed = session.ledger.step_completed
        completed(0.0, 0)  # an epoch begins: its first step's time is not measured from the last epoch's end
        watch_spikes = self.steps.spike_skip is not None  # no clock read per step without skip_spikes
        period = batch_end.period  # called for the records covering a multiple of it only (None: every batch)
        due = 0 if period is None else (start.step // period + 1) * period  # its next multiple (records are contiguous)
        spike_check = time.monotonic() + SPIKE_CHECK_SECONDS
        for record, carry in in_order(EpochSteps(self, train_fn, iter(batches)).dispatch(), lag):
            carry.block_until_ready()  # at most `lag` executions queued behind this one
            completed(time.perf_counter(), record.steps)
            ran, last = ran + record.steps, carry
            if watch_spikes and time.monotonic() >= spike_check:  # a long run of skipped spikes stops the run soon
                self.watch_spikes(host_metrics(carry), start.step, start.batch, start.epoch)
                spike_check = time.monotonic() + SPIKE_CHECK_SECONDS
            if batch_end.active and record.step >= due:  # it covers a multiple of the period (or has none)
                due = 0 if period is None else (record.step // period + 1) * period
                session.about(record, carry)
                batch_end(record.batch, functools.partial(logs_of, carry, order))
        if last is None:
            return 0, {}
        host = host_metrics(last)
        self.watch(host, start.step, start.batch, start.epoch)
        return ran, metrics_lib.compute(host.metrics, order)

    def make_tuner(self) -> StepsTuner | None:
        """Under ``steps_per_execution="auto"`` (not decided yet), a tuner capped by the epoch,
        the validation interval, ``max_steps`` and the callbacks' periods; under the default
        setting, one that fuses only where the rest of this fit repays the compile."""
        if not self.steps.tunes_steps or not self.strategy.fuses_steps or self.unfused:
            return None
        caps = [self.config.steps, self.callbacks.execution_cap, self.config.max_steps, self.every]
        self.last_ready = None
        cap = min((c for c in caps if c is not None), default=None)
        timings = self.loop.timings  # compile_factor: a fused compile measured on these devices, once one ran
        factor = timings.compile_factor or prior_compile_factor(self.strategy.devices[0].platform)
        tuner = StepsTuner(cap, self.remaining_steps(), self.steps.steps_by_default, factor)
        if tuner.steps is None and tuner.repaid_only and timings.host is not None and timings.device is not None:
            tuner.first_call(timings.first_call)  # an earlier fit timed the steps: decided without probes
            tuner.decide_from(timings.host, timings.device)
            self.settle(tuner)
        return tuner

    def remaining_steps(self) -> int | None:
        """The optimizer steps this fit has still to run (``None``: unknown, data of unknown length)."""
        position, config = self.session.position, self.config
        left = None if config.steps is None else config.steps * (config.epoch_count - position.epoch) - position.batch
        if config.max_steps is not None:
            left = config.max_steps - position.step if left is None else min(left, config.max_steps - position.step)
        return left

    def timed_step(self, train_fn: TreeFunction, totals: PackedTotals, batch: PyTree) -> PackedTotals:
        """One step run synchronously and timed for the tuner (the first call of a fit is not
        timed: it may compile); once it decided, the setup trains that many steps per call."""
        tuner = self.tuner
        assert tuner is not None  # only called while a tuner decides
        call, carried, keep = self.carried.calls(train_fn)
        start = time.perf_counter()
        state, totals = call(carried(), totals, batch)
        keep(state)
        back = time.perf_counter()
        totals.block_until_ready()
        ready = time.perf_counter()
        if self.last_ready is not None:
            tuner.record(host=back - self.last_ready, device=ready - back)
        else:  # with its compile, where the memory check compiled it before this call (an accelerator)
            first = ready - start + self.steps.compiled_ahead_seconds("train")
            tuner.first_call(self.loop.timings.saw_first_call(first))
        self.last_ready = ready
        if tuner.steps is not None:
            self.loop.timings.saw_steps(statistics.median(tuner.hosts), statistics.median(tuner.devices))
            self.settle(tuner)
        return totals

    def settle(self, tuner: StepsTuner) -> None:
        """The tuner decided: the setup trains that many steps per call from now on; or, under
        the default setting, a fit that would not repay fusing stays at one step per call and
        the next fit decides again (from these timings, without probes)."""
        assert tuner.steps is not None
        steps = distributed.broadcast_int(tuner.steps)  # timings differ per process: process 0 decides
        if steps == 1 and tuner.repaid_only:
            self.unfused = True
            return
        host, device = statistics.median(tuner.hosts), statistics.median(tuner.devices)
        reason = (
            f"picked {steps}: {1e6 * host:.0f} us of host time per call, {1e6 * device:.0f} us of device time per step"
        )
        self.steps.decide_steps(steps, reason)
        if tuner.repaid_only:  # the default: its guess checked on the first fused calls
            self.fused_check = FusedCheck(steps, max(host, device), time.perf_counter())  # k=1 overlaps them
        logger.info("steps_per_execution='auto' %s", reason)

    def checked_fused(self, check: FusedCheck) -> None:
        """The default's fused calls were timed (:class:`~trainkit.loop.tuning.FusedCheck`): the
        fused compile's cost is known on these devices, and where the fused steps were no faster
        than one step per call, this trainer trains one step per call from now on."""
        self.fused_check = None
        if check.compile_seconds is not None:
            self.loop.timings.saw_fused_compile(check.compile_seconds)
        if distributed.broadcast_int(int(bool(check.verdict))):  # process 0's timings decide for all
            return
        reason = (
            f"went back to 1: {check.steps} per call measured {1e6 * check.per_step():.1f} us a step against "
            f"{1e6 * check.single:.1f} us at one per call"
        )
        self.steps.decide_steps(1, reason)
        self.unfused = True
        logger.info("steps_per_execution (default) %s", reason)

    def watch(self, totals: EpochTotals, start_step: int, start_batch: int, epoch: int) -> None:
        """The epoch's warnings, from its totals: the first non-finite loss (unless a callback
        stops at it), and (once per run) ``SKIPPED_WARNING`` steps in a row skipped by the
        fp16 loss scale: the model is then not training at all. Labels outside the classes,
        which the step counted, stop the run with the batch that held them."""
        self.watch_spikes(totals, start_step, start_batch, epoch, ended=True)
        alarm = totals.metrics.get(LABEL_ALARM)
        if alarm is not None and int(alarm.count):
            step = int(alarm.step)
            where = f"Batch {start_batch + step - start_step - 1} of epoch {epoch} (step {step})"
            raise ValueError(self.steps.labels_message(int(alarm.count), int(alarm.value), where))
        bad = int(totals.first_non_finite)
        if self.warn_non_finite and bad:
            warn_user(non_finite_message(totals, start_step, start_batch, epoch))
        if totals.skipped_run is None:  # no loss scale: no step is skipped
            return
        self.skipped_in_a_row = int(totals.skipped_run)
        assert totals.skipped_alarm is not None and totals.skipped_scale is not None  # carried with a loss scale
        alarm = int(totals.skipped_alarm)
        if alarm:
            warn_user(
                f"The last {SKIPPED_WARNING} steps (up to step {start_step + alarm}) were all skipped: their "
                f"gradients were not finite at every loss scale down to {float(totals.skipped_scale):g}, so the "
                "parameters did not change. The loss or the model overflows in fp16: use precision='bf16', lower "
                "the learning rate, or look for a NaN in the data."
            )

    def watch_spikes(
        self, totals: EpochTotals, start_step: int, start_batch: int, epoch: int, ended: bool = False
    ) -> None:
        """``skip_spikes``: a run of skipped updates as long as ``stop_after`` raised (checked at
        most every ``SPIKE_CHECK_SECONDS`` and when the epoch ``ended``), and the epoch's skipped
        updates logged once it ended."""
        skip, report = self.steps.spike_skip, totals.metrics.get(SPIKES)
        if skip is None or report is None:
            return
        where = f"batch {start_batch + int(report.step) - start_step - 1} of epoch {epoch}"
        warning, error = spikes_lib.reported(report, where, skip.on)
        if error is not None:
            raise RuntimeError(error)
        if warning is not None and ended:
            logger.warning(warning)
            self.session.ledger.reassign(int(report.count), Bucket.SKIPPED)  # ran, not applied: not productive

    def validate_every(self, step: int) -> None:
        """``validation_interval``: after every N-th step is dispatched, validate on its state."""
        validation = self.config.validation
        if self.every is None or validation is None or step % self.every:
            return
        self.session.validating(step)
        try:
            with self.session.ledger.bucket(Bucket.VALIDATION):
                val_logs = self.loop.evaluate(*validation, self.callbacks, read_ahead=self.config.read_ahead)
        finally:
            self.session.validating(None)
        self.validation_logs = {f"val_{k}": v for k, v in val_logs.items()}


class Gathered(NamedTuple):
    """A placed fused span whose call gathers its batches on the devices (``data_on_device``):
    ``{"table", "rows", "mask"}``."""

    batch: PyTree


class EpochSteps:
    """The dispatch of one epoch's spans: each placed, its begin hook called, trained, and
    yielded with the totals after it (the epoch's totals live on the device, shaped by its first
    host batch)."""

    def __init__(self, run: FitRun, train_fn: TreeFunction, items: Iterator[Span | None]):
        self.run, self.train_fn, self.items = run, train_fn, items
        self.epoch = run.session.position.epoch
        self.totals: PackedTotals | None = None
        self.first_host: PyTree = None
        self.spec_seen = run.session.batch_spec is not None
        self.annotate = run.loop.annotate_steps or run.callbacks.annotates_steps
        self.every = run.steps.measured_every  # statistics due every this many steps (None: never)
        self._measured: tuple[TreeFunction, TreeFunction] | None = None
        self.aside = SetAside()  # the statistics' array, while the plain step runs

    def measured(self) -> tuple[TreeFunction, TreeFunction]:
        """The train step that measures the statistics, for their due steps: ``(function, call)``,
        its call taking the state as the loop carries it. Looked up before the first span of
        single steps (the lookup reads the live state's shapes, which a call inside a span
        donates: looked up at a due step inside a span, it read a deleted array)."""
        if self._measured is None:
            function = self.run.steps.function("train_measured")
            self._measured = function, self.run.carried.calls(function)[0]
        return self._measured

    def next_measuring(self, step: int) -> float:
        """The first step after ``step`` that calls the step measuring the statistics (infinity:
        none is measured; ``step + 1`` while :class:`~trainkit.loop.measuring.BetweenDue` measures
        every step). A span of single steps ending before it runs the plain loop, as without statistics."""
        between_due = self.run.between_due
        if between_due is None:
            return math.inf
        if between_due.measures_between():
            return step + 1
        return (step // between_due.every + 1) * between_due.every

    def for_step(self, measuring: bool, totals: PackedTotals) -> PackedTotals:
        """``totals`` as the train step takes them: whole for the step measuring the statistics
        (and the fused one), without the statistics' array for the plain one (:class:`SetAside`)."""
        if self.run.between_due is None:
            return totals
        return self.aside.whole(totals) if measuring else self.aside.plain(totals)

    def measures(self, step: int) -> bool:
        """Whether optimizer step ``step`` (from 1) calls the step that measures the statistics:
        a due step, or any while :class:`~trainkit.loop.measuring.BetweenDue` says so."""
        between_due = self.run.between_due  # None exactly when no statistics are measured
        return between_due is not None and (step % between_due.every == 0 or between_due.measures_between())

    def place(self, item: Span | None) -> Span | None:
        """A span of host batches on the devices: one stacked batch (``fused``) or a list."""
        if item is None:
            return None
        strategy, batches, session = self.run.strategy, item.batches, self.run.session
        if isinstance(batches, IndexedSpan):  # data_on_device: the rows, gathered by the call
            return self.place_indexed(item, batches)
        placed = strategy.put_batches(batches) if item.fused else [strategy.put_batch(b) for b in batches]
        if self.first_host is None:  # the first span's first host batch shapes the epoch's totals
            self.first_host = batches_at(batches, 0) if item.fused else batches[0]
        if not self.spec_seen:  # one batch's shapes and shardings, for lowering
            self.spec_seen = True
            session.saw_batch(abstract(strategy.put_batch(batches_at(batches, 0)) if item.fused else placed[0]))
        return Span(placed, item.fused, item.steps, item.data_state)  # not _replace: this runs every step

    def place_indexed(self, item: Span, indexed: IndexedSpan) -> Span:
        """A fused span named by its rows on the devices: the table (placed once) with the rows
        and masks, as ``"train_steps_gathered"`` takes them."""
        strategy = self.run.strategy
        if self.first_host is None or not self.spec_seen:  # its first batch, as the host would have sent it
            host = self.run.dataset.gather_indices(indexed.rows[0], indexed.mask[0])
            self.first_host = host if self.first_host is None else self.first_host
            if not self.spec_seen:
                self.spec_seen = True
                self.run.session.saw_batch(abstract(strategy.put_batch(host)))
        rows = strategy.put_batches({"rows": indexed.rows, "mask": indexed.mask})
        return Span(Gathered({"table": self.run.table(), **rows}), True, item.steps, item.data_state)

    def read(self) -> Span | Exception | None:
        """The next placed span; an error of the data is kept (noted with where it happened)
        and raised only after the span before it went through its hooks."""
        ledger = self.run.session.ledger
        previous = ledger.switch(Bucket.INPUT)  # the loop waits for the data
        try:
            item = next(self.items, None)
            ledger.switch(previous)
            return self.place(item)
        except Exception as error:  # noqa: BLE001 - the loader's own error, re-raised as it is
            ledger.switch(previous)
            position = self.run.session.position
            error.add_note(
                f"trainkit: raised by the data while reading batch {position.batch} of epoch {self.epoch}; the "
                f"trainer's state is that of step {position.step}, the last one run, and is intact."
            )
            return error

    def start_totals(self) -> PackedTotals:
        run = self.run
        empty = run.steps.empty_totals("train", self.first_host)
        totals: PackedTotals = run.strategy.put_replicated(pack(empty.continuing(run.skipped_in_a_row)))
        return totals

    def dispatch(self) -> Iterator[tuple[StepRecord, PackedTotals]]:
        """Each span trained, with its record and the totals after it. The host reads and places
        the next span while the device runs this one; its step is dispatched only after this
        span's hooks ran. A one-shot iterator is not read ahead: a stop would lose the batch read.
        The plain path (one call per batch) is written out here: it is the dispatch-bound loop."""
        run, epoch, annotate, train_fn = self.run, self.epoch, self.annotate, self.train_fn
        session, batch_begin, read_ahead = run.session, run.callbacks.on_train_batch_begin, run.read_ahead
        call, carried, keep = self.run.carried.calls(train_fn)
        between_due = run.between_due  # None exactly when no statistics are measured
        measure_from = self.next_measuring(session.position.step)  # no call measures before this step
        upcoming = self.read()
        while upcoming is not None:
            if isinstance(upcoming, Exception):
                raise upcoming
            placed, fused, steps, data_state = upcoming
            totals = self.totals if self.totals is not None else self.start_totals()
            position = session.position
            record = StepRecord(position.step + steps, epoch, position.batch + steps - 1, steps)
            if batch_begin.active:
                session.about(record)
                batch_begin(record.first_batch)
            renting = between_due is not None and between_due.renting and not fused
            if between_due is not None and self._measured is None and not fused:
                self.measured()  # before the span's calls donate the state it reads
            started = time.perf_counter() if renting else 0.0
            if fused or (run.tuner is not None and run.tuner.steps is None):
                totals = self.train_otherwise(placed, fused, totals, record)
            elif annotate:  # the span's batches one call each, each marked for the profile
                state = carried()
                for number, batch in enumerate(placed, start=position.step + 1):
                    with jax.profiler.StepTraceAnnotation("train", step_num=number):
                        measuring = self.measures(number)
                        step_call = self.measured()[1] if measuring else call
                        state, totals = step_call(state, self.for_step(measuring, totals), batch)
                keep(state)
            elif record.step < measure_from:  # the span's batches one call each; no hook reads the state in between
                state = carried()
                if between_due is not None:
                    totals = self.aside.plain(totals)
                for batch in placed:
                    state, totals = call(state, totals, batch)
                keep(state)
            else:  # the same, the statistics' due steps (and at first the others: BetweenDue) measuring
                state, number, every = carried(), position.step, self.every
                assert between_due is not None and every is not None and self._measured is not None  # looked up above
                measure = self._measured[1]
                between, aside = between_due.measures_between(), self.aside
                for batch in placed:
                    number += 1
                    if between or number % every == 0:
                        state, totals = measure(state, aside.whole(totals), batch)
                    else:
                        state, totals = call(state, aside.plain(totals), batch)
                keep(state)
                measure_from = self.next_measuring(record.step)
            if renting and between_due is not None:  # the span's seconds (the first span's: the compile)
                between_due.ran(time.perf_counter() - started)
            self.totals = totals
            run.watchdog.progress(record.step)
            session.moved(Position(epoch, record.batch + 1, record.step), data_state)
            if run.every is not None:
                run.validate_every(record.step)
            upcoming = self.read() if read_ahead else None
            yield record, totals
            if run.done():
                return
            if not read_ahead:
                upcoming = self.read()

    def train_otherwise(self, placed: PyTree, fused: bool, totals: PackedTotals, record: StepRecord) -> PackedTotals:
        """A span not trained one plain call per batch: one fused call (``steps_per_execution``),
        or timed single steps while ``steps_per_execution="auto"`` decides."""
        run = self.run
        if not fused:
            for number, batch in enumerate(placed, start=record.step - record.steps + 1):
                measuring = self.measures(number)
                function = self.measured()[0] if measuring else self.train_fn
                totals = run.timed_step(function, self.for_step(measuring, totals), batch)
            return totals
        gathered = isinstance(placed, Gathered)  # data_on_device: the call gathers its batches
        function = run.steps.function("train_steps_gathered" if gathered else "train_steps")
        call, carried, keep = run.carried.calls(function)
        check = run.fused_check
        if check is not None:
            check.calling(time.perf_counter())  # the first fused call compiles
        with jax.profiler.StepTraceAnnotation("train", step_num=record.step) if self.annotate else _NO_TRACE:
            state, totals = call(carried(), self.for_step(True, totals), placed.batch if gathered else placed)
        keep(state)
        if check is not None:  # the default's guess, checked on its first fused calls
            totals.block_until_ready()
            check.ready(time.perf_counter())
            if check.verdict is not None:
                run.checked_fused(check)
        return totals


def refuse_changed_values(changed: list[str], epoch: int) -> None:
    """Stops ``fit`` (the state that of epoch ``epoch``'s end, intact) when a value the user's own
    step reads from ``self`` changed during it: the compiled step keeps the one it was traced with,
    so the change (a callback's annealing) would be ignored without a word."""
    if changed:
        raise RuntimeError(
            f"The train step reads self.{changed[0].split(':')[0]}, which changed during this fit ({changed[0]}, "
            f"by the end of epoch {epoch}; a callback?), but the compiled step keeps the value it was traced with: "
            "the change would be ignored. Keep a value that changes while training in the state (a frozen "
            "parameter or a model variable, written with trainer.update_state), or change it between fits (each "
            "fit traces the step again with it). The trainer's state is that of this epoch's end."
        )


def non_finite_message(totals: EpochTotals, start_step: int, start_batch: int, epoch: int) -> str:
    """The warning for an epoch's first non-finite step (``totals.first_non_finite`` set): a loss
    that is not finite, or (the gradient norm logged) a gradient that is not, behind a finite loss.
    Without the norm, a NaN gradient shows one step late, in the next step's loss: the warning
    says how to have it named where it happened."""
    bad, loss = int(totals.first_non_finite), float(totals.first_non_finite_loss)
    where = f"step {start_step + bad} (batch {start_batch + bad - 1} of epoch {epoch})"
    stop = "Add tk.callbacks.TerminateOnNaN() to stop at the first non-finite step."
    if math.isfinite(loss):
        return (
            f"The gradient is not finite at {where}, whose loss ({loss:.6g}) is: the parameters it updated are "
            "not finite from then on (a norm or square root at zero, a log of zero, a division by a zero row); "
            f"training goes on. {stop}"
        )
    unnamed = (
        ""
        if GRAD_NORM in totals.metrics
        else " When the step before had a finite loss, its gradient may have been what was not finite; "
        "Trainer(log_grad_norm=True) names the step whose gradient was."
    )
    return f"The loss is {loss} at {where}; training goes on.{unnamed} {stop}"
