"""``EarlyStopping``: stop when a monitored metric stops improving (Keras semantics).

>>> stopper = EarlyStopping(monitor="val_loss", patience=1)
>>> stopper.monitor_.mode
'min'
"""

from __future__ import annotations

from trainkit.callbacks.base import Callback, Logs, Monitor


class EarlyStopping(Callback):
    """Stops training after ``patience`` epochs without an improvement larger than ``min_delta``.

    Args:
        monitor: a logged name such as ``"val_loss"`` or ``"accuracy"``.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (max for accuracy-like names).
        patience: epochs without improvement before stopping.
        min_delta: the smallest change that counts as an improvement.
        restore_best_weights: when stopping, put back the parameters and model state of the
            best epoch (kept as host copies, fetched only when a new best arrives).
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        mode: str = "auto",
        patience: int = 0,
        min_delta: float = 0.0,
        restore_best_weights: bool = False,
    ):
        self.monitor_ = Monitor(monitor, mode, min_delta)
        self.patience = patience
        self.restore_best_weights = restore_best_weights
        self.wait = 0
        self.stopped_epoch: int | None = None
        self.best_epoch: int | None = None
        self.best_weights = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self.monitor_ = Monitor(self.monitor_.monitor, self.monitor_.mode, self.monitor_.min_delta)
        self.wait, self.stopped_epoch, self.best_epoch, self.best_weights = 0, None, None, None

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        value = self.monitor_.value(logs, "EarlyStopping")
        if value is None:
            return
        if self.monitor_.improved(value):
            self.wait, self.best_epoch = 0, epoch
            if self.restore_best_weights:
                self.best_weights = self.trainer.get_weights()
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_epoch = epoch
            self.trainer.stop_training = True
            if self.restore_best_weights and self.best_weights is not None:
                self.trainer.set_weights(self.best_weights)
