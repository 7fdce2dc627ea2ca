"""``Callback``: Keras-named hooks run on the host; ``CallbackList`` dispatches them.

>>> class CountEpochs(Callback):
...     def __init__(self):
...         self.epochs = 0
...     def on_epoch_end(self, epoch, logs=None):
...         self.epochs += 1
>>> callbacks = CallbackList([CountEpochs()], trainer=None)
>>> callbacks.on_epoch_end(0, {"loss": 1.0}); callbacks.callbacks[0].epochs
1
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Iterable

Logs = dict[str, float]

HOOKS = (
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_test_begin",
    "on_test_end",
    "on_predict_begin",
    "on_predict_end",
)


class Callback:
    """Base class: override any hook. ``self.trainer`` is set before training starts; set
    ``self.trainer.stop_training = True`` to stop after the current step.

    ``on_train_batch_end(batch, logs)`` receives the batch index inside the epoch and the
    running epoch means; trainkit calls it a step or two late, when that step's metrics have
    arrived, so the device is never blocked to serve a callback.
    """

    trainer: Any = None

    def set_trainer(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_begin(self, logs: Logs | None = None) -> None: ...
    def on_train_end(self, logs: Logs | None = None) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None: ...
    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None: ...
    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_test_begin(self, logs: Logs | None = None) -> None: ...
    def on_test_end(self, logs: Logs | None = None) -> None: ...
    def on_predict_begin(self, logs: Logs | None = None) -> None: ...
    def on_predict_end(self, logs: Logs | None = None) -> None: ...


class CallbackList:
    """Calls each hook on the callbacks that override it (no per-step cost for the others)."""

    def __init__(self, callbacks: Iterable[Callback], trainer: Any):
        self.callbacks = list(callbacks)
        for callback in self.callbacks:
            if not isinstance(callback, Callback):
                raise TypeError(
                    f"Callbacks must subclass trainkit.callbacks.Callback; received "
                    f"{type(callback).__name__}."
                )
            callback.set_trainer(trainer)
        for hook in HOOKS:
            bound = [getattr(c, hook) for c in self.callbacks if _overrides(c, hook)]
            setattr(self, hook, self._dispatcher(bound))

    @staticmethod
    def _dispatcher(bound):
        def call(*args):
            for fn in bound:
                fn(*args)

        call.active = bool(bound)  # type: ignore[attr-defined]
        return call


def _overrides(callback: Callback, hook: str) -> bool:
    fn = getattr(callback, hook)
    return getattr(fn, "__func__", fn) is not getattr(Callback, hook)


def resolve_mode(monitor: str, mode: str) -> str:
    """``"min"`` or ``"max"``; ``"auto"`` means max for accuracy-like names, else min."""
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"mode must be 'auto', 'min' or 'max'; received {mode!r}.")
    if mode != "auto":
        return mode
    name = monitor.removeprefix("val_")
    return "max" if any(k in name for k in ("acc", "auc", "precision", "recall", "f1")) else "min"


class Monitor:
    """Tracks the best value of one logged quantity (shared by early stopping and checkpoints)."""

    def __init__(self, monitor: str, mode: str = "auto", min_delta: float = 0.0):
        self.monitor = monitor
        self.mode = resolve_mode(monitor, mode)
        self.min_delta = abs(min_delta)
        self.best = math.inf if self.mode == "min" else -math.inf

    def value(self, logs: Logs | None, who: str) -> float | None:
        logs = logs or {}
        if self.monitor not in logs:
            warnings.warn(
                f"{who} monitors {self.monitor!r}, which is not among the logged metrics: "
                f"{', '.join(sorted(logs)) or '(none)'}. Pass one of these as monitor= "
                "(validation metrics need validation_data).",
                stacklevel=3,
            )
            return None
        return float(logs[self.monitor])

    def improved(self, value: float) -> bool:
        """Whether ``value`` beats the best by more than ``min_delta`` (and records it)."""
        if math.isnan(value):
            return False
        better = (
            value < self.best - self.min_delta
            if self.mode == "min"
            else value > self.best + self.min_delta
        )
        if better:
            self.best = value
        return better
