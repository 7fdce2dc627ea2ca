"""``CallbackList``: calls each hook on the callbacks that implement it, with Keras's
arguments, after adding the default callbacks as Keras's ``CallbackList`` does (``History``,
then the progress bar).

>>> from trainkit.callbacks.base import Callback
>>> class CountEpochs(Callback):
...     def __init__(self):
...         self.epochs = 0
...     def on_epoch_end(self, epoch, logs=None):
...         self.epochs += 1
>>> callbacks = CallbackList([CountEpochs()], trainer=None, add_history=True)
>>> callbacks.on_epoch_end(0, {"loss": 1.0}); callbacks.callbacks[0].epochs, callbacks.history.history
(1, {'loss': [1.0]})
>>> callbacks.async_train   # no batch-level hook: the loop may run ahead
True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from trainkit import distributed
from trainkit.callbacks.backup_and_restore import BackupAndRestore
from trainkit.callbacks.base import _ALIASES, _BATCH_END, Callback, Logs, RunParams, overrides
from trainkit.callbacks.history import History
from trainkit.callbacks.progress import ProgressBar
from trainkit.callbacks.ray_train_report import RayTrainReport
from trainkit.callbacks.trainer_view import TrainerView
from trainkit.core.statistics import StepStatistics
from trainkit.core.warn import warn_user
from trainkit.distributed import ray_train
from trainkit.loop.hooks import BatchEndHook, ExceptionHook, IndexedHook, RunHook
from trainkit.record.ledger import Ledger


def _keras_logs(logs: Logs | None) -> Logs:
    """A fresh dict with sorted keys, as Keras's ``pythonify_logs`` passes: every callback of one
    hook call sees the same dict, so one may add a key (e.g. ``learning_rate``) for the next."""
    return dict(sorted((logs or {}).items()))


def _trainkit_callback_named(name: str) -> type | None:
    """trainkit's callback class of that name (``EarlyStopping``), if it has one."""
    pending = [Callback]
    while pending:
        cls = pending.pop()
        if cls.__name__ == name and cls.__module__.startswith("trainkit."):
            return cls
        pending.extend(cls.__subclasses__())
    return None


def _not_a_callback(callback: object) -> str:
    """Why ``callback`` is refused and what to pass: for a Keras callback trainkit has, its class."""
    cls = type(callback)
    ours = _trainkit_callback_named(cls.__name__) if cls.__module__.startswith("keras") else None
    if ours is not None:
        return (
            f"callbacks received keras.callbacks.{cls.__name__}, a Keras callback, which drives a Keras model. "
            f"Pass tk.callbacks.{ours.__name__}(...) with the same arguments instead (trainkit's, with Keras's "
            "behaviour and hook order)."
        )
    return (
        f"Callbacks must subclass trainkit.callbacks.Callback; received {cls.__name__}. "
        "A Keras callback's code runs unchanged once its class derives from tk.callbacks.Callback."
    )


def with_ray_report(callbacks: list[Callback]) -> list[Callback]:
    """``callbacks`` with a :class:`RayTrainReport` (appended, after the user's callbacks, unless
    one is listed) reporting the list's ``BackupAndRestore``: one per fit, as Ray records one
    run's checkpoints."""
    backups = [c for c in callbacks if isinstance(c, BackupAndRestore)]
    if len(backups) > 1:
        raise ValueError(
            f"This fit has {len(backups)} BackupAndRestore callbacks; inside a Ray Train worker their backups "
            "become Ray's checkpoints, one series per fit. Keep one BackupAndRestore."
        )
    reports = [c for c in callbacks if isinstance(c, RayTrainReport)]
    if not reports:
        reports = [RayTrainReport()]
        callbacks = [*callbacks, *reports]
    for report in reports:
        if report.backup is None and backups:
            report.backup = backups[0]
    return callbacks


#: each callback implementing a hook, with its method and its goodput ledger bucket
Bound = list[tuple[Callback, Callable[..., Any], str]]


def _bucket(callback: Callback) -> str:
    return callback.goodput_bucket or f"callbacks/{type(callback).__name__}"


class BoundCalls:
    """The callbacks' functions of one hook (``bound``), each call's time in the callback's
    bucket of the goodput ``ledger``."""

    def __init__(self, bound: Bound, ledger: Ledger):
        self.bound, self.ledger = bound, ledger

    def timed(self, bucket: str, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)``, its time in ``bucket`` of the goodput ledger."""
        previous = self.ledger.switch(bucket)
        try:
            fn(*args)
        finally:
            self.ledger.switch(previous)


class Dispatcher(RunHook):
    """One hook of a :class:`CallbackList` about a whole run: called on each callback that
    implements it, in list order, with a fresh dict of sorted ``logs`` (as Keras's
    ``pythonify_logs`` passes: every callback of one call sees the same dict, so one may add a
    key for the next), each call's time in the callback's bucket of the goodput ``ledger``.
    ``active``: some callback implements it (the loop then builds its arguments)."""

    def __init__(self, bound: Bound, ledger: Ledger):
        self.calls, self.active = BoundCalls(bound, ledger), bool(bound)

    def __call__(self, logs: Logs | None = None) -> None:
        logs = _keras_logs(logs)
        for _, fn, bucket in self.calls.bound:
            self.calls.timed(bucket, fn, logs)


class IndexedDispatcher(IndexedHook):
    """A hook about one epoch or batch: ``hook(index, logs)`` (as :class:`Dispatcher`)."""

    def __init__(self, bound: Bound, ledger: Ledger):
        self.calls, self.active = BoundCalls(bound, ledger), bool(bound)

    def __call__(self, index: int, logs: Logs | None = None) -> None:
        logs = _keras_logs(logs)
        for _, fn, bucket in self.calls.bound:
            self.calls.timed(bucket, fn, index, logs)


class BatchEndDispatcher(BatchEndHook):
    """A batch-end hook: ``logs`` may be a function that computes them (reading the device),
    called only once a callback that reads this hook's logs comes, its time the loop's (not
    charged to that callback: waiting for the step and reading its metrics is the loop's work).
    The callbacks before that one get a dict of what they add, merged into the logs when read.
    ``periodic`` (the train hook): its ``period`` is the greatest common divisor of the
    callbacks' :meth:`~trainkit.callbacks.Callback.batch_end_period` (``None`` when one has none)."""

    def __init__(self, bound: Bound, ledger: Ledger, periodic: bool = False):
        self.calls, self.active = BoundCalls(bound, ledger), bool(bound)
        periods = [callback.batch_end_period() for callback, _, _ in bound] if periodic else [None]
        if periods and all(p is not None for p in periods):
            self.period = math.gcd(*(int(p) for p in periods if p is not None))

    def __call__(self, index: int, logs: Logs | Callable[[], Logs] | None = None) -> None:
        shared, switch = None if callable(logs) else _keras_logs(logs), self.calls.ledger.switch
        added: Logs = {}  # what callbacks before the first reader put in the logs (Keras's one dict)
        for callback, fn, bucket in self.calls.bound:
            if shared is None and callback.reads_batch_logs():  # the loop's work (waiting for the step, reading
                shared = _keras_logs(logs() if callable(logs) else logs)  # its metrics): in the loop's bucket
                shared.update(added)
            previous = switch(bucket)
            try:
                fn(index, added if shared is None else shared)
            finally:
                switch(previous)


class ExceptionDispatcher(ExceptionHook):
    """``on_exception(error)``: a callback that raises while handling it only warns (the
    original error matters more)."""

    def __init__(self, bound: Bound, ledger: Ledger):
        self.calls, self.active = BoundCalls(bound, ledger), bool(bound)

    def __call__(self, exception: BaseException) -> None:
        for _, fn, _ in self.calls.bound:
            try:
                fn(exception)
            except Exception as error:  # noqa: BLE001 - the original error matters more
                warn_user(f"on_exception of {fn} raised {error!r} while handling {exception!r}")


class CallbackList:
    """Calls each hook on the callbacks that implement it, in list order, with Keras's arguments
    (it is the :class:`~trainkit.loop.Hooks` the loop calls).

    ``async_train`` / ``async_test`` / ``async_predict``: whether every callback implementing a
    batch-end hook of that kind is ``async_safe`` (then the loop may run ahead of the hooks).
    Each hook has ``active``: ``False`` when no callback implements it, so the loop skips
    building its arguments.
    """

    @classmethod
    def for_run(
        cls, callbacks: Iterable[Callback] | None, trainer: TrainerView, verbose: int | str, steps: int | None,
        epochs: int = 1, fit: bool = False,
    ) -> CallbackList:  # fmt: skip
        """Keras's callback list of a ``fit`` / ``evaluate`` / ``predict``: ``fit`` adds ``History``
        (kept as the trainer's history) and, when verbose on the main process, the progress bar;
        inside a Ray Train worker, ``fit`` also reports to Ray (:func:`with_ray_report`)."""
        progress = fit and bool(verbose) and distributed.is_main_process()
        params = RunParams(verbose=verbose, epochs=epochs, steps=steps)
        listed = cls.checked(callbacks)
        if fit and ray_train.worker_job() is not None:
            listed = with_ray_report(listed)
        made = cls(listed, trainer, params, add_history=fit, add_progress_bar=progress)
        if fit:  # the History that fit returns is the trainer's from now on
            trainer.session.keep_history(made.require_history())
        return made

    def __init__(
        self,
        callbacks: Iterable[Callback],
        trainer: TrainerView | None,
        params: RunParams | None = None,
        *,
        add_history: bool = False,
        add_progress_bar: bool = False,
    ):
        self.callbacks = self.checked(callbacks)
        self.history: History | None = None
        if add_history:  # Keras's order: the user's callbacks, History, then the progress bar
            self.history = next((c for c in self.callbacks if isinstance(c, History)), None)
            if self.history is None:
                self.history = History()
                self.callbacks.append(self.history)
        if add_progress_bar and not any(isinstance(c, ProgressBar) for c in self.callbacks):
            self.callbacks.append(ProgressBar())  # its verbose from params (set below; "auto" is 1)
        for callback in self.callbacks:
            callback.set_model(trainer)
            if params is not None:
                callback.set_params(params)
        self.async_train, self.async_test, self.async_predict = (self._runs_ahead(kind) for kind in _BATCH_END)
        ledger = trainer.session.ledger if trainer is not None else Ledger()  # a bare list: an idle clock
        self.on_train_begin: RunHook = Dispatcher(self._bound("on_train_begin"), ledger)
        self.on_train_end: RunHook = Dispatcher(self._bound("on_train_end"), ledger)
        self.on_epoch_begin: IndexedHook = IndexedDispatcher(self._bound("on_epoch_begin"), ledger)
        self.on_epoch_end: IndexedHook = IndexedDispatcher(self._bound("on_epoch_end"), ledger)
        self.on_train_batch_begin: IndexedHook = IndexedDispatcher(self._bound("on_train_batch_begin"), ledger)
        self.on_train_batch_end: BatchEndHook = BatchEndDispatcher(
            self._bound("on_train_batch_end"), ledger, periodic=True
        )
        self.on_test_begin: RunHook = Dispatcher(self._bound("on_test_begin"), ledger)
        self.on_test_end: RunHook = Dispatcher(self._bound("on_test_end"), ledger)
        self.on_test_batch_begin: IndexedHook = IndexedDispatcher(self._bound("on_test_batch_begin"), ledger)
        self.on_test_batch_end: BatchEndHook = BatchEndDispatcher(self._bound("on_test_batch_end"), ledger)
        self.on_predict_begin: RunHook = Dispatcher(self._bound("on_predict_begin"), ledger)
        self.on_predict_end: RunHook = Dispatcher(self._bound("on_predict_end"), ledger)
        self.on_predict_batch_begin: IndexedHook = IndexedDispatcher(self._bound("on_predict_batch_begin"), ledger)
        self.on_predict_batch_end: BatchEndHook = BatchEndDispatcher(self._bound("on_predict_batch_end"), ledger)
        self.on_exception: ExceptionHook = ExceptionDispatcher(self._bound("on_exception"), ledger)

    def _runs_ahead(self, kind: str) -> bool:
        """Every callback implementing a batch-end hook of ``kind`` is ``async_safe``."""
        return not any(not c.async_safe and any(overrides(c, h) for h in _BATCH_END[kind]) for c in self.callbacks)

    def _bound(self, hook: str) -> Bound:
        """The callbacks implementing ``hook`` (or its Keras alias), with their methods."""
        alias = _ALIASES.get(hook)
        return [
            (c, getattr(c, hook), _bucket(c))
            for c in self.callbacks
            if overrides(c, hook) or (alias is not None and overrides(c, alias))
        ]

    def require_history(self) -> History:
        """The ``History`` that ``fit`` returns (a list made with ``add_history``)."""
        if self.history is None:
            raise RuntimeError("This callback list has no History: it was made for evaluate or predict.")
        return self.history

    @staticmethod
    def checked(callbacks: Iterable[Callback] | None) -> list[Callback]:
        """``callbacks`` as a list, each a trainkit callback, or a ``TypeError`` saying what to
        pass (before anything is built)."""
        if isinstance(callbacks, Callback):
            raise TypeError(
                f"callbacks takes a list of callbacks, as in Keras; received one {type(callbacks).__name__}: "
                f"pass callbacks=[{type(callbacks).__name__}(...)]."
            )
        callbacks = list(callbacks or ())
        for callback in callbacks:
            if isinstance(callback, type) and issubclass(callback, Callback):
                raise TypeError(
                    f"callbacks received the class {callback.__name__}, not a callback: instantiate it, "
                    f"callbacks=[tk.callbacks.{callback.__name__}(...)]."
                )
            if not isinstance(callback, Callback):
                raise TypeError(_not_a_callback(callback))
        return callbacks

    @property
    def execution_cap(self) -> int | None:
        """The most steps one compiled call may cover for every callback (``None``: any)."""
        caps = [cap for cap in (c.execution_cap() for c in self.callbacks) if cap is not None]
        return min(caps, default=None)

    @property
    def annotates_steps(self) -> bool:
        """Whether a callback profiles steps (the loop then marks each one)."""
        return any(c.annotates_steps for c in self.callbacks)

    @staticmethod
    def step_statistics_of(callbacks: Iterable[Callback]) -> StepStatistics | None:
        """What one of ``callbacks`` needs the train step to measure (``GradientStats``), read
        before anything compiles; two that ask are refused."""
        asked = [spec for spec in (c.step_statistics() for c in callbacks) if spec is not None]
        if len(asked) > 1:
            raise ValueError(
                f"{len(asked)} callbacks ask the train step for statistics ({asked}); pass one GradientStats."
            )
        return asked[0] if asked else None

    @property
    def stops_on_non_finite(self) -> bool:
        """Whether a callback stops training at a non-finite loss (``TerminateOnNaN``): the
        loop's own warning is then not needed."""
        return any(c.stops_on_non_finite for c in self.callbacks)
