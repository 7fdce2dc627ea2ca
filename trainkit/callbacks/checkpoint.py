"""Checkpoint callbacks: ``ModelCheckpoint`` (keep the best or the latest) and
``BackupAndRestore`` (resume an interrupted ``fit`` exactly, also after SIGTERM).

>>> import tempfile
>>> ModelCheckpoint(tempfile.mkdtemp(), save_best_only=True).monitor_.mode
'min'
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import threading
import warnings

from trainkit.callbacks.base import Callback, Logs, Monitor
from trainkit.callbacks.triggers import Every
from trainkit.checkpoint import Checkpointer

logger = logging.getLogger("trainkit")


def _finite_loss(logs: Logs | None) -> bool:
    loss = (logs or {}).get("loss")
    return loss is None or math.isfinite(loss)


class ModelCheckpoint(Callback):
    """Saves the full training state with orbax (asynchronously, written cooperatively by all
    processes), every ``every_n_epochs`` epochs and/or every ``every_n_steps`` steps.

    Args:
        directory: where checkpoints go (one orbax step directory each).
        monitor: the logged name that ranks checkpoints when ``save_best_only``.
        mode: ``"min"``, ``"max"`` or ``"auto"`` for ``monitor``.
        save_best_only: save only when ``monitor`` improves, and keep the best
            ``max_to_keep``; otherwise keep the latest ``max_to_keep``.
        max_to_keep: how many checkpoints stay on disk (``None``: all).
        every_n_steps: also save every this many optimizer steps.
        every_n_epochs: save at the end of every this many epochs (``None``: never).

    A step whose loss is NaN or infinite is never saved, so the last good checkpoint is not
    replaced by a broken one.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        monitor: str = "val_loss",
        mode: str = "auto",
        save_best_only: bool = False,
        max_to_keep: int | None = 3,
        every_n_steps: int | None = None,
        every_n_epochs: int | None = 1,
    ):
        self.directory = os.fspath(directory)
        self.monitor_ = Monitor(monitor, mode)
        self.save_best_only = save_best_only
        self.max_to_keep = max_to_keep
        self.trigger = Every(every_n_steps, every_n_epochs)
        self.checkpointer: Checkpointer | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        monitor = self.monitor_.monitor
        if self.checkpointer is None:
            self.checkpointer = Checkpointer(
                self.directory,
                max_to_keep=self.max_to_keep,
                best_fn=(lambda metrics: metrics[monitor]) if self.save_best_only else None,
                best_mode=self.monitor_.mode,
            )
        self._logs: Logs = {}

    def _save(self, logs: Logs | None) -> None:
        step = self.trainer.global_step
        if not _finite_loss(logs):
            warnings.warn(
                f"ModelCheckpoint: not saving step {step}: the loss is {logs['loss']}. The last "
                "good checkpoint stays.", stacklevel=3,
            )
            return
        metrics = None
        if self.save_best_only:
            value = self.monitor_.value(logs, "ModelCheckpoint")
            if value is None or not self.monitor_.improved(value):
                return
            metrics = {self.monitor_.monitor: value}
        self.checkpointer.save(step, self.trainer.state, self.trainer.manifest(), metrics=metrics)

    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        if self.trigger.step_due(self.trainer.global_step):  # the live state is at that step
            self._save(self._logs)

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self._logs = logs or {}

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.trigger.epoch_due(epoch) or self.trigger.step_due(self.trainer.global_step):
            self._save(logs)

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self.checkpointer is not None:
            if self.trigger.step_due(self.trainer.global_step) and not self.trainer.preempted:
                self._save(self._logs)
            self.checkpointer.wait()

    @property
    def best_step(self) -> int | None:
        return self.checkpointer.best_step() if self.checkpointer else None


class BackupAndRestore(Callback):
    """Makes ``fit`` resumable: when ``directory`` holds a backup, ``fit`` continues from it
    exactly (the full ``TrainState``, the epoch and the position inside it, hence the shuffle
    order), so a resumed run ends with the parameters of an uninterrupted one, bit for bit
    (same device count and strategy).

    A backup is written every ``every_n_steps`` steps and at every epoch end. On SIGTERM
    (preemption) the current step finishes, a backup is written and the process exits with
    ``trainkit.trainer.PREEMPTED_EXIT_CODE`` (143); running the same command again resumes.
    When training completes, the backup is deleted (``delete_on_end``).
    """

    def __init__(self, directory: str | os.PathLike, every_n_steps: int | None = 100,
                 delete_on_end: bool = True):
        self.directory = os.fspath(directory)
        self.trigger = Every(every_n_steps)
        self.delete_on_end = delete_on_end
        self.checkpointer: Checkpointer | None = None
        self.restored_step: int | None = None
        self._previous_handler = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        trainer = self.trainer
        self.checkpointer = Checkpointer(self.directory, max_to_keep=2)
        self.restored_step = None
        if self.checkpointer.latest_step() is not None:
            position = trainer.position_after(trainer.load(self.checkpointer))
            trainer.resume_position = position
            self.restored_step = trainer.global_step
            logger.warning(
                "BackupAndRestore: resuming from step %d (epoch %d, batch %d) in %s.",
                trainer.global_step, position["epoch"], position["batch"], self.directory,
            )
        self._logs: Logs = {}
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        logger.warning("BackupAndRestore: SIGTERM received; finishing the current step, then "
                       "writing a backup and exiting.")
        self.trainer.preempted = True
        self.trainer.stop_training = True

    def _save(self, wait: bool = False) -> None:
        self.checkpointer.save(self.trainer.global_step, self.trainer.state, self.trainer.manifest(), wait=wait)

    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        if self.trigger.step_due(self.trainer.global_step) and _finite_loss(self._logs):
            self._save()

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self._logs = logs or {}

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if _finite_loss(logs):
            self._save()

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None
        if self.trainer.preempted:
            self._save(wait=True)
            self.checkpointer.close()
            logger.warning("BackupAndRestore: backup of step %d written to %s; exiting.",
                           self.trainer.global_step, self.directory)
            return
        self.checkpointer.close()
        if self.delete_on_end:
            shutil.rmtree(self.directory, ignore_errors=True)
