"""``Session``: the one holder of a run's mutable state, and the immutable records it hands out.

A trainer has one session. It holds the live :class:`~trainkit.core.state.TrainState`, the
:class:`Position` (the next batch to train and the optimizer steps applied), the data
iterator's position, the stop and preemption flags and what a hook is about (the
:class:`StepRecord`). The loop, the setup and the callbacks read it and change it only through
its methods: nothing else holds these values, and nothing assigns the session's attributes.
:meth:`Session.snapshot` is all of it as one frozen :class:`Snapshot`, which
:meth:`Session.restore` puts back (a trial ``fit`` such as ``find_learning_rate``).

Modelled on Levanter's ``StepInfo`` (hooks read an immutable record of the step) and kauldron's
``train_impl`` (the live state has one holder), within Keras's callback contract: a callback
may still ask to stop (``request_stop``), resume elsewhere (``resume_at``) or be preempted.

>>> session = Session()
>>> session.position, session.stop_requested
(Position(epoch=0, batch=0, step=0), False)
>>> session.resume_at(Position(epoch=2, batch=3, step=11)); session.start, session.position.step
(Position(epoch=2, batch=3, step=11), 11)
>>> saved = session.snapshot(); session.request_stop(); session.restore(saved); session.stop_requested
False
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from trainkit.core.state import TrainState
from trainkit.core.totals import PackedTotals
from trainkit.core.tree import JSON, PyTree
from trainkit.core.warn import warn_user
from trainkit.record.ledger import Ledger


class Position(NamedTuple):
    """Where training stands: the next batch to train (``epoch``, ``batch`` inside it) and the
    optimizer steps applied so far (``step``).

    >>> Position(epoch=1, batch=4, step=10).rebatched(8, 16)
    Position(epoch=1, batch=2, step=10)
    """

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


@dataclasses.dataclass(frozen=True)
class FitView:
    """What a running ``fit`` tells its hooks, fixed when it begins: the global batch size, the
    names its epoch logs hold (Keras 2's ``params["metrics"]``)."""

    batch_size: int | None = None
    logged_names: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Everything a :class:`Session` holds at one moment (see :meth:`Session.snapshot`)."""

    state: TrainState | None = None
    position: Position = Position()
    record: StepRecord | None = None
    carry: PackedTotals | None = None
    epoch_start: Position = Position()
    data_state: JSON = None
    resume_state: JSON = None
    start: Position | None = None
    stop_requested: bool = False
    preempted: bool = False
    fit: FitView = FitView()
    batch_spec: PyTree = None
    validating_at: int | None = None
    history: Any = None


class Session:
    """The live state, the position, the data state and the flags of one trainer's runs.

    Read by anyone (read-only properties); written only through the methods below, each named
    for the event it records. The fields are listed once, in :class:`Snapshot`: an event
    replaces the frozen value ``_now`` with the fields it changes, except seven that are slots
    of their own. Five a training step writes (the state, the position, the data state, the
    record and the carry): replacing a frozen value of 14 fields costs about 4 µs here, three
    events a step, against a loop whose own Python is about 10 µs a step (docs/performance.md).
    Two a signal handler writes (the stop and preemption flags): a handler that replaced
    ``_now`` while the main thread was replacing it too would be undone. ``_now``'s copies of
    those seven are not read (the state and the carry are dropped from it:
    device arrays it would keep alive).
    """

    __slots__ = (
        "_now", "_state", "_unbuilt", "_position", "_data_state", "_record", "_carry", "_stop_requested", "_preempted",
        "_ledger",
    )  # fmt: skip
    _now: Snapshot
    _state: TrainState | None
    # how to build the live state when it is not built yet (a fit's carried leaves: loop/carried.py)
    _unbuilt: Callable[[], TrainState] | None
    _position: Position
    _data_state: JSON
    _record: StepRecord | None
    _carry: PackedTotals | None
    _stop_requested: bool
    _preempted: bool
    _ledger: Ledger

    def __init__(self) -> None:
        self.restore(Snapshot())
        self._ledger = Ledger()

    def _event(self, **changes: Any) -> None:
        """The cold fields after an event: ``_now`` replaced (``changes`` are :class:`Snapshot` fields)."""
        self._now = dataclasses.replace(self._now, **changes)

    # ------------------------------------------------------------------ reads
    @property
    def state(self) -> TrainState | None:
        """The live ``TrainState`` (``None`` before ``fit`` or ``init``); after steps whose state
        a fit holds in another form (:meth:`stepped_unbuilt`), built when first read."""
        if self._state is None and self._unbuilt is not None:
            self._state = self._unbuilt()
        return self._state

    def require_state(self) -> TrainState:
        state = self.state
        if state is None:
            raise RuntimeError("The trainer has no state yet: call fit(...) or init(sample_batch) first.")
        return state

    def holds_unbuilt(self, build: Callable[[], TrainState]) -> bool:
        """Whether the live state is still the one ``build`` makes (none written since)."""
        return self._unbuilt is build

    @property
    def position(self) -> Position:
        """The next batch to train and the optimizer steps applied (dispatched) so far."""
        return self._position

    @property
    def record(self) -> StepRecord | None:
        """The batch (or execution) the running batch hook is about."""
        return self._record

    def require_record(self) -> StepRecord:
        """The record of the batch the running hook is about (a batch hook of ``fit``)."""
        if self._record is None:
            raise RuntimeError("No batch is being trained: the record exists inside fit's batch hooks.")
        return self._record

    @property
    def carry(self) -> PackedTotals | None:
        """The device totals the last train-batch hook was given (this epoch's so far)."""
        return self._carry

    @property
    def epoch_start(self) -> Position:
        """Where this epoch's totals count from (its first batch and the steps done before it)."""
        return self._now.epoch_start

    @property
    def data_state(self) -> JSON:
        """The data iterator's position after the last batch trained (``None``: not checkpointable)."""
        return self._data_state

    @property
    def resume_state(self) -> JSON:
        """This process's saved iterator position the first epoch of this ``fit`` continues from."""
        return self._now.resume_state

    @property
    def start(self) -> Position | None:
        """Where this ``fit`` starts when a callback said so (:meth:`resume_at`), else ``None``."""
        return self._now.start

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    @property
    def preempted(self) -> bool:
        return self._preempted

    @property
    def batch_size(self) -> int | None:
        """The global batch size of the running (or last) ``fit``."""
        return self._now.fit.batch_size

    @property
    def logged_names(self) -> tuple[str, ...] | None:
        """What the running ``fit``'s epoch logs hold (known before ``on_train_begin``)."""
        return self._now.fit.logged_names

    @property
    def batch_spec(self) -> PyTree:
        """The shapes and shardings of the last ``fit``'s batches (for lowering its step)."""
        return self._now.batch_spec

    @property
    def validating_at(self) -> int | None:
        """The step of a validation every N steps, while it runs."""
        return self._now.validating_at

    @property
    def history(self) -> Any:
        """The ``History`` the last ``fit`` returned (``trainer.history``), ``None`` before."""
        return self._now.history

    @property
    def ledger(self) -> Ledger:
        """The clock of the running ``fit``'s goodput ledger (idle between fits); its result, once
        the loop ends, is :attr:`goodput`."""
        return self._ledger

    # ------------------------------------------------------------------ writes
    def replace_state(self, state: TrainState, *, moves_position: bool = True) -> None:
        """A new live state (created, restored or edited); the position's step follows it
        unless only the variables changed (``moves_position=False``)."""
        self._state, self._unbuilt = state, None
        if moves_position:
            self._position = self._position._replace(step=int(state.step))

    def stepped(self, state: TrainState) -> None:
        """The state after a dispatched step (the position moves with :meth:`moved`)."""
        self._state, self._unbuilt = state, None

    def stepped_unbuilt(self, build: Callable[[], TrainState], built: TrainState | None = None) -> None:
        """The state after a dispatched step, held by the fit in another form: ``build()`` makes
        the ``TrainState`` when something reads it (``built``: it is already)."""
        self._state, self._unbuilt = built, build

    def begin_fit(self, view: FitView, position: Position) -> None:
        """A ``fit`` begins at ``position``: no stop, no resume, no record yet."""
        self.restore(Snapshot(state=self.state, position=position, fit=view, history=self._now.history))

    def keep_history(self, history: Any) -> None:
        """The ``History`` of the ``fit`` that begins (``trainer.history`` from now on)."""
        self._event(history=history)

    def moved(self, position: Position, data_state: JSON = None) -> None:
        """Training reached ``position``; the data iterator's position is then ``data_state``."""
        self._position, self._data_state = position, data_state

    def about(self, record: StepRecord, carry: PackedTotals | None = None) -> None:
        """The batch hook that runs next is about ``record`` (and was given ``carry``'s totals)."""
        self._record = record
        if carry is not None:
            self._carry = carry

    def epoch_began(self, start: Position) -> None:
        """A new epoch's totals count from ``start``: none read yet."""
        self._carry = None
        self._event(epoch_start=start)

    def saw_batch(self, spec: PyTree) -> None:
        """One placed batch's shapes and shardings (for lowering)."""
        self._event(batch_spec=spec)

    def validating(self, step: int | None) -> None:
        """A validation every N steps runs on the state of ``step`` (``None``: it ended)."""
        self._event(validating_at=step)

    def request_stop(self) -> None:
        """Stop before the next batch (``trainer.stop_training = True`` calls this)."""
        self._stop_requested = True

    def set_stop_requested(self, value: bool) -> None:
        """``trainer.stop_training = value``: stop before the next batch, or no longer."""
        self._stop_requested = bool(value)

    def preempt(self) -> None:
        """Stop before the next batch, run ``on_train_end``, then raise ``Preempted``. Safe to
        call from a signal handler."""
        self._preempted = self._stop_requested = True

    def resume_at(
        self, position: Position, saved_batch_size: int | None = None, data_state: list[JSON] | None = None
    ) -> None:
        """Start this ``fit`` at ``position`` instead of ``initial_epoch`` (call it from
        ``on_train_begin``); a batch index written with another batch size is converted by
        examples seen. ``data_state``: the data iterators' saved positions, one per process
        (a checkpointable iterator continues from it instead of skipping batches)."""
        start = position.rebatched(saved_batch_size, self.batch_size)
        self._position = self._position._replace(step=position.step)
        resumed: JSON = None
        if data_state is not None and (len(data_state) != jax.process_count() or start != position):
            warn_user(
                f"The data iterator's saved position was written by {len(data_state)} process(es) with batch size "
                f"{saved_batch_size}; this run has {jax.process_count()} with {self.batch_size}. The iterator "
                "restarts and skips the batches already trained instead."
            )
        elif data_state is not None:
            resumed = data_state[jax.process_index()]
        self._data_state = resumed
        self._event(start=start, resume_state=resumed)

    # ------------------------------------------------------------------ all of it
    def snapshot(self) -> Snapshot:
        """Everything held now, as one frozen value (the state is the live one: fetch it to
        keep it across a step, which donates it)."""
        return dataclasses.replace(
            self._now, state=self.state, position=self._position, data_state=self._data_state, record=self._record,
            carry=self._carry, stop_requested=self._stop_requested, preempted=self._preempted,
        )  # fmt: skip

    def restore(self, snapshot: Snapshot) -> None:
        """Puts a :meth:`snapshot` back whole."""
        self._now = dataclasses.replace(snapshot, state=None, carry=None)  # held by the slots, not kept twice
        self._state, self._unbuilt, self._position = snapshot.state, None, snapshot.position
        self._data_state, self._record, self._carry = snapshot.data_state, snapshot.record, snapshot.carry
        self._stop_requested, self._preempted = snapshot.stop_requested, snapshot.preempted
