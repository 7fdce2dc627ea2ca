"""``ReduceLROnPlateau`` and ``LearningRateScheduler``: change the learning rate between
epochs (Keras 3's callbacks), through the optimizer state of ``optax.inject_hyperparams``.
Under an optimizer per group (``optimizer={"generator": ..., ...}``) each changes every group's
rate, or ``group=``'s alone, and logs ``learning_rate/<group>``.

>>> ReduceLROnPlateau(factor=0.5, patience=2).factor
0.5
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from trainkit.callbacks.base import Callback, Logs, MonitorCallback
from trainkit.callbacks.trainer_view import TrainerView
from trainkit.core.warn import warn_user


def _rates(model: TrainerView, group: str | None) -> dict[str | None, float]:
    """The rates a callback changes: ``group``'s, or every group's (``{None: rate}``: one optimizer)."""
    rates = model.state_access.learning_rates()
    if group is None:
        return rates
    if group not in rates:
        raise ValueError(f"group={group!r} is not an optimizer group: the groups are {[g for g in rates if g]}.")
    return {group: rates[group]}


def _log_rates(model: TrainerView, logs: Logs) -> None:
    """``learning_rate`` (one optimizer) or ``learning_rate/<group>`` into the epoch's logs."""
    for group, rate in model.state_access.learning_rates().items():
        logs["learning_rate" if group is None else f"learning_rate/{group}"] = rate


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
        group: str | None = None,
        **kwargs,
    ):
        super().__init__(monitor, mode, min_delta=min_delta)
        self.group = group  # an optimizer group's rate alone (None: every group's)
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
        _log_rates(self.model, logs)
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
                for group, old in _rates(self.model, self.group).items():
                    if old > np.float32(self.min_lr):
                        new = max(old * self.factor, self.min_lr)
                        self.model.state_access.set_learning_rate(new, group)
                        if self.verbose > 0:
                            name = "learning rate" if group is None else f"{group}'s learning rate"
                            print(f"\nEpoch {epoch + 1}: ReduceLROnPlateau reducing {name} to {new}.")
                        self.cooldown_counter, self.wait = self.cooldown, 0


class LearningRateScheduler(Callback):
    """Sets the learning rate at every epoch start to ``schedule(epoch, lr)`` (or
    ``schedule(epoch)``), a Python float, as Keras does; ``learning_rate`` joins the epoch logs.
    For a per-step schedule, pass an optax schedule to the optimizer instead."""

    def __init__(self, schedule: Callable[..., float], verbose: int = 0, group: str | None = None):
        self.schedule, self.verbose, self.group = schedule, verbose, group  # group: as ReduceLROnPlateau's

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        for group, current in _rates(self.model, self.group).items():
            try:
                rate = self.schedule(epoch, current)
            except TypeError:  # the old one-argument form
                rate = self.schedule(epoch)
            if not isinstance(rate, (float, np.float32, np.float64)):
                raise ValueError(f"The output of the `schedule` function should be a float. Got: {rate!r}")
            self.model.state_access.set_learning_rate(float(rate), group)
            if self.verbose > 0:
                name = "learning rate" if group is None else f"{group}'s learning rate"
                print(f"\nEpoch {epoch + 1}: LearningRateScheduler setting {name} to {rate}.")

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if logs is not None:
            _log_rates(self.model, logs)
