"""``ReduceLROnPlateau`` and ``LearningRateScheduler``: change the learning rate between
epochs (Keras 3's callbacks), through the optimizer state of ``optax.inject_hyperparams``.

>>> ReduceLROnPlateau(factor=0.5, patience=2).factor
0.5
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from trainkit.callbacks.base import Callback, Logs, MonitorCallback
from trainkit.core.warn import warn_user


class ReduceLROnPlateau(MonitorCallback):
    """Multiplies the learning rate by ``factor`` after ``patience`` epochs without an
    improvement of ``monitor`` larger than ``min_delta``, then waits ``cooldown`` epochs; never
    below ``min_lr``. The optimizer must expose its learning rate:
    ``optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)`` (a clear error otherwise).
    Adds ``learning_rate`` to the epoch logs, as Keras does."""

    def __init__(
        self,
        monitor: str = "val_loss",
        factor: float = 0.1,
        patience: int = 10,
        verbose: int = 0,
        mode: str = "auto",
        min_delta: float = 1e-4,
        cooldown: int = 0,
        min_lr: float = 0.0,
        **kwargs,
    ):
        super().__init__(monitor, mode, min_delta=min_delta)
        if factor >= 1.0:
            raise ValueError(f"ReduceLROnPlateau does not support a factor >= 1.0. Received factor={factor}")
        self.factor, self.min_lr, self.patience = factor, min_lr, patience
        self.verbose, self.cooldown = verbose, cooldown
        self.cooldown_counter = 0
        self.wait = 0

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self.best, self.cooldown_counter, self.wait = None, 0, 0
        self.model.state_access.require_settable_learning_rate()  # fails now, not after an epoch, if it cannot be set

    def in_cooldown(self) -> bool:
        return self.cooldown_counter > 0

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        logs = logs if logs is not None else {}
        logs["learning_rate"] = self.model.learning_rate
        current = logs.get(self.monitor)
        if current is None:
            warn_user(
                f"Learning rate reduction is conditioned on metric `{self.monitor}` which is not "
                f"available. Available metrics are: {','.join(logs)}."
            )
            return
        if self.in_cooldown():
            self.cooldown_counter -= 1
            self.wait = 0
        if self._is_improvement(current, self.best):
            self.best, self.wait = current, 0
        elif not self.in_cooldown():
            self.wait += 1
            if self.wait >= self.patience:
                old = self.model.learning_rate
                if old > np.float32(self.min_lr):
                    new = max(old * self.factor, self.min_lr)
                    self.model.learning_rate = new
                    if self.verbose > 0:
                        print(f"\nEpoch {epoch + 1}: ReduceLROnPlateau reducing learning rate to {new}.")
                    self.cooldown_counter, self.wait = self.cooldown, 0


class LearningRateScheduler(Callback):
    """Sets the learning rate at every epoch start to ``schedule(epoch, lr)`` (or
    ``schedule(epoch)``), a Python float, as Keras does; ``learning_rate`` joins the epoch logs.
    For a per-step schedule, pass an optax schedule to the optimizer instead."""

    def __init__(self, schedule: Callable, verbose: int = 0):
        self.schedule, self.verbose = schedule, verbose

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        current = self.model.learning_rate
        try:
            rate = self.schedule(epoch, current)
        except TypeError:  # the old one-argument form
            rate = self.schedule(epoch)
        if not isinstance(rate, (float, np.float32, np.float64)):
            raise ValueError(f"The output of the `schedule` function should be a float. Got: {rate!r}")
        self.model.learning_rate = float(rate)
        if self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: LearningRateScheduler setting learning rate to {rate}.")

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if logs is not None:
            logs["learning_rate"] = self.model.learning_rate
