"""``CSVLogger``: one row per epoch, in Keras 3's columns, written by process 0.

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "log.csv")
>>> logger = CSVLogger(path)
>>> logger.on_train_begin(); logger.on_epoch_end(0, {"loss": 0.5}); logger.on_train_end()
>>> open(path).read().splitlines()
['epoch,loss,val_loss', '0,0.5,NA']
"""

from __future__ import annotations

import collections.abc
import csv
import os
from typing import TextIO

import numpy as np

from trainkit import distributed
from trainkit.callbacks.base import Callback, Logs
from trainkit.core.local_path import LocalPath, require_local


def _cell(value):
    if isinstance(value, str) or (isinstance(value, np.ndarray) and value.ndim == 0):
        return value
    if isinstance(value, collections.abc.Iterable):
        return f'"[{", ".join(map(str, value))}]"'
    return value


class CSVLogger(Callback):
    """Writes ``epoch`` and the sorted log keys (plus ``val_`` twins when the first epoch has
    no validation keys), ``NA`` where a value is missing, as Keras does.

    Args:
        filename: the file to write.
        separator: the column separator.
        append: add to an existing file (no second header) instead of overwriting it.
    """

    def __init__(self, filename: LocalPath, separator: str = ",", append: bool = False):
        self.sep = separator
        self.filename = require_local(filename, "CSVLogger's filename")
        self.append = append
        self.writer: csv.DictWriter[str] | None = None  # once the header is known
        self.keys: list[str] | None = None
        self.append_header = True
        self.csv_file: TextIO | None = None  # the open file while a fit runs

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._close()
        if not distributed.is_main_process():  # one file per run, written by process 0
            return
        if self.append and os.path.exists(self.filename):
            with open(self.filename) as f:
                self.append_header = not bool(len(f.readline()))
        self.csv_file = open(self.filename, "a" if self.append else "w", newline="")
        self.writer, self.keys = None, None

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.csv_file is None:
            return
        logs = logs or {}
        if self.keys is None:
            self.keys = sorted(logs)
            if self.keys and not any(k.startswith("val_") for k in self.keys):
                self.keys.extend(f"val_{k}" for k in list(self.keys))
        if self.writer is None:
            dialect = type("Dialect", (csv.excel,), {"delimiter": self.sep})
            self.writer = csv.DictWriter(self.csv_file, fieldnames=["epoch", *self.keys], dialect=dialect)
            if self.append_header:
                self.writer.writeheader()
        self.writer.writerow({"epoch": epoch, **{k: _cell(logs.get(k, "NA")) for k in self.keys}})
        self.csv_file.flush()

    def _close(self) -> None:
        if self.csv_file is not None and not self.csv_file.closed:
            self.csv_file.close()
        self.csv_file, self.writer = None, None

    def on_train_end(self, logs: Logs | None = None) -> None:
        self._close()

    def on_exception(self, exception: BaseException) -> None:
        self._close()
