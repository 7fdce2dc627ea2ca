"""Logging callbacks: ``CSVLogger``, ``TerminateOnNaN`` and ``LambdaCallback``.

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "log.csv")
>>> logger = CSVLogger(path)
>>> logger.on_train_begin(); logger.on_epoch_end(0, {"loss": 0.5}); logger.on_train_end()
>>> open(path).read().splitlines()
['epoch,loss', '0,0.5']
"""

from __future__ import annotations

import csv
import math
import os
import warnings
from typing import Callable

from trainkit import distributed
from trainkit.callbacks.base import Callback, Logs


class CSVLogger(Callback):
    """Writes one row per epoch (``epoch`` then every logged metric) to a CSV file.

    Args:
        filename: the file to write.
        separator: the column separator.
        append: add to an existing file instead of overwriting it.
    """

    def __init__(self, filename: str | os.PathLike, separator: str = ",", append: bool = False):
        self.filename = os.fspath(filename)
        self.separator = separator
        self.append = append
        self._file = None
        self._writer = None
        self._keys: list[str] | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._file = None
        if not distributed.is_main_process():  # one file per run, written by process 0
            return
        exists = self.append and os.path.exists(self.filename) and os.path.getsize(self.filename)
        self._file = open(self.filename, "a" if self.append else "w", newline="")
        self._keys, self._writer = None, None
        if exists:
            with open(self.filename, newline="") as f:
                header = next(csv.reader(f, delimiter=self.separator), None)
            self._keys = header[1:] if header else None

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self._file is None:
            return
        logs = logs or {}
        if self._keys is None:
            self._keys = sorted(logs, key=lambda k: (k.startswith("val_"), k != "loss", k))
        if self._writer is None:
            self._writer = csv.DictWriter(
                self._file, fieldnames=["epoch", *self._keys], delimiter=self.separator,
                extrasaction="ignore", restval="",
            )
            if not (self.append and self._file.tell()):
                self._writer.writeheader()
        self._writer.writerow({"epoch": epoch, **logs})
        self._file.flush()

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TerminateOnNaN(Callback):
    """Stops training when the loss becomes NaN or infinite, naming the step."""

    def __init__(self):
        self.stopped_step: int | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self.stopped_step = None

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        loss = (logs or {}).get("loss")
        if self.stopped_step is None and loss is not None and not math.isfinite(loss):
            self.stopped_step = self.trainer.reported_step
            warnings.warn(
                f"TerminateOnNaN: the loss became {loss} at batch {batch} of epoch "
                f"{self.trainer.epoch} (step {self.stopped_step}, counting from 1); stopping "
                "training.",
                stacklevel=2,
            )
            self.trainer.stop_training = True


class LambdaCallback(Callback):
    """A callback built from plain functions, e.g.
    ``LambdaCallback(on_epoch_end=lambda epoch, logs: print(epoch, logs["loss"]))``."""

    def __init__(self, **hooks: Callable):
        for name, fn in hooks.items():
            if not hasattr(Callback, name) or not name.startswith("on_"):
                raise ValueError(f"LambdaCallback: unknown hook {name!r}.")
            setattr(self, name, fn)

    def set_trainer(self, trainer) -> None:  # functions are not methods: no self argument
        self.trainer = trainer
