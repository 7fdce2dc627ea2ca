"""``EarlyStopping``: stop when a monitored metric stops improving (Keras 3's semantics).

>>> stopper = EarlyStopping(monitor="val_loss", patience=1)
>>> stopper.mode, stopper.patience
('min', 1)
"""

from __future__ import annotations

from trainkit.callbacks.base import Logs, MonitorCallback


class EarlyStopping(MonitorCallback):
    """Stops training when ``monitor`` has not improved for ``patience`` epochs (Keras 3's
    arguments, order and attributes: ``best``, ``best_epoch``, ``stopped_epoch``, ``wait``).

    Args:
        monitor: a logged name such as ``"val_loss"`` or ``"accuracy"``.
        min_delta: the smallest change that counts as an improvement.
        patience: epochs without improvement before stopping (never at epoch 0).
        verbose: 1 prints when it stops and when it restores weights.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (max for accuracy-like names).
        baseline: a value the monitored quantity must beat; epochs that do not beat it count
            towards ``patience`` even when they improve on each other.
        restore_best_weights: at the end of training (however it ends: patience, another
            callback, or the last epoch) put back the variables of the best epoch.
        start_from_epoch: epochs to wait before monitoring.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0.0,
        patience: int = 0,
        verbose: int = 0,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best_weights: bool = False,
        start_from_epoch: int = 0,
    ):
        super().__init__(monitor, mode, min_delta=min_delta)
        self.patience = patience
        self.verbose = verbose
        self.baseline = baseline
        self.restore_best_weights = restore_best_weights
        self.start_from_epoch = start_from_epoch
        self.wait = 0
        self.stopped_epoch = 0
        self.best_epoch = 0
        self.best_weights = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self.wait, self.stopped_epoch, self.best, self.best_weights, self.best_epoch = 0, 0, None, None, 0

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        current = self.get_monitor_value(logs)
        if current is None or epoch < self.start_from_epoch:
            return
        if self.restore_best_weights and self.best_weights is None:
            self.best_weights, self.best_epoch = self.model.get_weights(), epoch
        self.wait += 1
        if self._is_improvement(current, self.best):
            self.best, self.best_epoch = current, epoch
            if self.restore_best_weights:
                self.best_weights = self.model.get_weights()
            if self.baseline is None or self._is_improvement(current, self.baseline):
                self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.model.stop_training = True

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self.stopped_epoch > 0 and self.verbose > 0:
            print(f"Epoch {self.stopped_epoch + 1}: early stopping")
        if self.restore_best_weights and self.best_weights is not None:
            if self.verbose > 0:
                print(f"Restoring model weights from the end of the best epoch: {self.best_epoch + 1}.")
            self.model.set_weights(self.best_weights)
