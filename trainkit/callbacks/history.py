"""``History``: one value per epoch for every logged metric, as Keras returns from ``fit``.

>>> h = History()
>>> h.on_train_begin(); h.on_epoch_end(0, {"loss": 0.5}); h.on_epoch_end(1, {"loss": 0.25})
>>> h.epoch, h.history["loss"]
([0, 1], [0.5, 0.25])
"""

from __future__ import annotations

from trainkit.callbacks.base import Callback, Logs
from trainkit.record.ledger import Goodput


class History(Callback):
    """Keras-compatible: ``history.history[name]`` lists one value per epoch; ``epoch`` lists
    the epoch indices; ``params`` holds ``epochs``, ``steps`` and ``verbose``. ``fit`` adds it
    after the user's callbacks (as Keras does), so keys they add to the epoch logs are kept.
    With ``fit(validation_interval=N)``, ``validations`` lists one dict per validation:
    ``{"step": s, "val_loss": ..., ...}`` (the epoch logs carry the latest one).
    ``goodput`` (trainkit's): where the ``fit``'s wall time went, a
    :class:`~trainkit.record.ledger.Goodput` (docs/monitoring.md), once it ended."""

    def __init__(self) -> None:
        self.history: dict[str, list[float]] = {}
        self.epoch: list[int] = []
        self.validations: list[Logs] = []
        self.goodput: Goodput | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self.history, self.epoch, self.validations, self.goodput = {}, [], [], None

    def on_train_end(self, logs: Logs | None = None) -> None:
        self.goodput = self.session.ledger.last if self.trainer is not None else None

    def on_test_end(self, logs: Logs | None = None) -> None:
        step = self.session.validating_at if self.trainer is not None else None
        if step is not None:  # a validation every N steps, not an epoch-end one
            self.validations.append({"step": step, **{f"val_{k}": v for k, v in (logs or {}).items()}})

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        self.epoch.append(epoch)
        for name, value in (logs or {}).items():
            self.history.setdefault(name, []).append(value)

    def plot(self, path: str, title: str | None = None):
        """Train and validation curves of the loss and each metric, one panel each, saved as a
        PNG at ``path`` (needs matplotlib); returns the matplotlib figure."""
        from trainkit.monitoring.plot import plot_curves

        return plot_curves(self.history, path, title=title)
