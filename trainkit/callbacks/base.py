"""``Callback``: Keras 3's hooks, arguments and attributes.

Code written for Keras 3 callbacks runs unchanged: every hook takes ``logs``; ``self.model``
(the :class:`trainkit.Trainer`, also ``self.trainer``; typed as a :class:`TrainerView`) has
``stop_training``, ``get_weights``, ``set_weights`` and ``save``; ``self.params`` holds
``verbose``, ``epochs`` and ``steps``. trainkit adds ``self.session``, the trainer's typed
:class:`~trainkit.record.session.Session` (the position, the :class:`~trainkit.record.session.StepRecord`
of the batch a hook is about, ``resume_at`` / ``request_stop`` / ``preempt``), and
``on_exception(error)``, called instead of ``on_train_end`` when ``fit`` raises.

>>> class CountEpochs(Callback):
...     def on_epoch_end(self, epoch, logs=None):
...         print(epoch, logs)
>>> overrides(CountEpochs(), "on_epoch_end"), overrides(CountEpochs(), "on_train_end")
(True, False)
"""

from __future__ import annotations

import inspect
from typing import TypedDict

from trainkit.callbacks.trainer_view import TrainerView
from trainkit.core.statistics import StepStatistics
from trainkit.core.warn import warn_user
from trainkit.loop.hooks import Logs
from trainkit.record.ledger import Bucket
from trainkit.record.session import Session


class RunParams(TypedDict, total=False):
    """Keras's ``callback.params`` of the running call (a plain dict at run time)."""

    verbose: int | str  # 0, 1, 2 or "auto"
    epochs: int
    steps: int | None  # batches per epoch (None: not known before the data ends)


#: Every hook, with the aliases ``on_batch_begin`` / ``on_batch_end`` of the train-batch hooks.
HOOKS = (
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_test_begin",
    "on_test_end",
    "on_test_batch_begin",
    "on_test_batch_end",
    "on_predict_begin",
    "on_predict_end",
    "on_predict_batch_begin",
    "on_predict_batch_end",
    "on_exception",
)
_ALIASES = {"on_train_batch_begin": "on_batch_begin", "on_train_batch_end": "on_batch_end"}
_BATCH_END = {
    "train": ("on_train_batch_end", "on_batch_end"),
    "test": ("on_test_batch_end",),
    "predict": ("on_predict_batch_end",),
}


class Callback:
    """Base class: override any hook (Keras 3's names and arguments).

    Attributes set before the first hook:
        model, trainer: the :class:`trainkit.Trainer` (one object, two names).
        params: ``{"verbose": ..., "epochs": ..., "steps": ...}`` of the running call.

    ``async_safe``: at ``on_train_batch_end(i)`` the trainer's state is the state after batch
    ``i``, and ``self.model.stop_training = True`` stops before batch ``i + 1``: the loop waits
    for each batch. A callback whose batch-end hook needs neither sets ``async_safe = True``
    (Keras's flag); when every batch-level callback does, the loop runs a few steps ahead and
    the hook sees the metrics of batch ``i`` a little later.
    """

    trainer: TrainerView | None = None
    params: RunParams | None = None
    async_safe: bool = False
    #: Stops training at the first non-finite loss (``TerminateOnNaN``).
    stops_on_non_finite: bool = False
    #: Profiles steps: the loop then marks each one (``jax.profiler.StepTraceAnnotation``).
    annotates_steps: bool = False
    #: The goodput ledger's bucket for the time spent in this callback's hooks (``None``:
    #: ``"callbacks/<class name>"``); the checkpoint callbacks' is ``"checkpoint"``.
    goodput_bucket: Bucket | str | None = None

    def step_statistics(self) -> StepStatistics | None:
        """What this callback needs the compiled train step to measure (``GradientStats``'s
        norms), read when ``fit`` begins; ``None``: nothing."""
        return None

    def execution_cap(self) -> int | None:
        """The most steps one compiled call may cover for this callback's batch hooks to mean
        what they say, under ``steps_per_execution="auto"`` (``None``: any). By default 1 for
        a callback whose train-batch hooks are not ``async_safe`` (it expects a call per
        batch, as Keras makes them); periodic callbacks give their period."""
        hooks = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")
        return 1 if not self.async_safe and any(overrides(self, h) for h in hooks) else None

    def batch_end_period(self) -> int | None:
        """Every how many optimizer steps this callback's ``on_train_batch_end`` does anything
        (``None``: at every batch, as Keras calls it). When every callback with that hook gives
        one, the loop calls the hook only for the batches (or fused calls) that cover a multiple
        of their greatest common divisor: the other batches cost no call at all."""
        return None

    def reads_batch_logs(self) -> bool:
        """Whether the coming batch-end hook reads its ``logs`` (by default it does, as in
        Keras). The metrics stay on the device until a callback reads them, so a callback that
        reads them only now and then (the progress bar, on a clock; a logger every
        ``update_freq`` steps) says so, and between those calls gets a dict of what the
        callbacks before it added (a callback may add values without reading: the next one that
        reads gets them with the metrics) and costs no device-to-host read."""
        return True

    @property
    def model(self) -> TrainerView:
        """Keras's name for :attr:`trainer` (set before the first hook)."""
        if self.trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a trainer: pass it to fit(callbacks=[...]).")
        return self.trainer

    @model.setter
    def model(self, value: TrainerView) -> None:
        self.trainer = value

    @property
    def session(self) -> Session:
        """The trainer's session: the live state, the position, the record of the batch a hook
        is about, and the explicit requests (``request_stop``, ``resume_at``, ``preempt``)."""
        return self.model.session

    def set_model(self, model: TrainerView | None) -> None:
        self.trainer = model

    def set_trainer(self, trainer: TrainerView | None) -> None:
        self.trainer = trainer

    def set_params(self, params: RunParams | None) -> None:
        self.params = params

    def on_train_begin(self, logs: Logs | None = None) -> None: ...
    def on_train_end(self, logs: Logs | None = None) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None: ...
    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None: ...
    def on_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        """Alias of ``on_train_batch_begin``, as in Keras."""

    def on_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Alias of ``on_train_batch_end``, as in Keras."""

    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        self.on_batch_begin(batch, logs=logs)

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self.on_batch_end(batch, logs=logs)

    def on_test_begin(self, logs: Logs | None = None) -> None: ...
    def on_test_end(self, logs: Logs | None = None) -> None: ...
    def on_test_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_test_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_predict_begin(self, logs: Logs | None = None) -> None: ...
    def on_predict_end(self, logs: Logs | None = None) -> None: ...
    def on_predict_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_predict_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...

    def on_exception(self, exception: BaseException) -> None:
        """trainkit's hook for a ``fit`` that raises (``on_train_end`` is not called, as in
        Keras): release what ``on_train_begin`` took (files, signal handlers, pending writes)."""


def overrides(callback: Callback, hook: str) -> bool:
    """Whether ``callback`` implements ``hook`` itself (a method or an instance attribute)."""
    return inspect.getattr_static(callback, hook) is not inspect.getattr_static(Callback, hook)


def resolve_mode(monitor: str, mode: str) -> str:
    """``"min"`` or ``"max"``; ``"auto"``: min for a loss, max for accuracy-like names, and for
    any other name still ``"auto"``, decided from the trainer's metrics at the first value.

    Keras warns on an unknown ``mode`` and falls back to ``"auto"``; trainkit raises, since a
    misspelt mode would silently watch the wrong direction."""
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"mode must be 'auto', 'min' or 'max'; received {mode!r}.")
    if mode != "auto":
        return mode
    name = monitor.removeprefix("val_")
    if "loss" in name:
        return "min"
    return "max" if any(k in name for k in ("acc", "auc", "precision", "recall", "f1")) else "auto"


class MonitorCallback(Callback):
    """Base of callbacks that watch one logged quantity (Keras's ``MonitorCallback``): ``best``
    starts at ``baseline`` (``None``: the first value is an improvement), and a value improves
    on a reference by more than ``min_delta`` in the direction of ``mode``."""

    def __init__(
        self, monitor: str = "val_loss", mode: str = "auto", baseline: float | None = None, min_delta: float = 0.0
    ):
        self.monitor = monitor
        self.mode = resolve_mode(monitor, mode)
        self.best = baseline
        self.min_delta = abs(min_delta)

    def _is_improvement(self, value: float, reference: float | None) -> bool:
        if self.mode == "auto":
            self.mode = self._auto_mode()
        if reference is None:
            return True
        if self.mode == "min":
            return value + self.min_delta < reference
        return value - self.min_delta > reference

    def _auto_mode(self) -> str:
        """``mode="auto"`` for a name that does not say its direction: the trainer's metric of
        that name knows it (``mae``: min); a metric of your own, or an unknown name, raises as
        in Keras, since guessing would silently watch the wrong direction."""
        name = self.monitor.removeprefix("val_")
        directions = self.trainer.objective.directions if self.trainer is not None else {}
        direction = directions.get(name)
        if direction is not None:
            return direction
        what = "a metric of your own" if name in directions else f"not among the metrics ({', '.join(directions)})"
        raise ValueError(
            f"{type(self).__name__} received monitor={self.monitor!r} with mode='auto', but {name!r} is {what}, "
            "so whether it should be maximized or minimized is not known. Pass mode='max' to keep the highest "
            "value, or mode='min' to keep the lowest."
        )

    def get_monitor_value(self, logs: Logs | None) -> float | None:
        """The monitored value, or ``None`` with a warning naming the logged quantities."""
        if self.mode == "auto":
            self.mode = self._auto_mode()
        logs = logs or {}
        if self.monitor not in logs:
            warn_user(
                f"{type(self).__name__} monitors {self.monitor!r}, which is not among the logged metrics: "
                f"{', '.join(sorted(logs)) or '(none)'}. Pass one of these as monitor= "
                "(validation metrics need validation_data)."
            )
            return None
        return float(logs[self.monitor])
