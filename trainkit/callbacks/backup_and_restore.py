"""``BackupAndRestore``: resume an interrupted ``fit`` exactly, also after SIGTERM (preemption).

>>> import tempfile
>>> BackupAndRestore(tempfile.mkdtemp(), save_freq=100).save_freq.value
100
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from typing import Any

from trainkit import distributed
from trainkit.callbacks.base import Callback, Logs
from trainkit.callbacks.triggers import SaveFrequency
from trainkit.checkpoint import Checkpointer, CheckpointError, checked_position, remove_checkpoints
from trainkit.checkpoint.directory import foreign_entries
from trainkit.checkpoint.manifest import Manifest
from trainkit.core.local_path import LocalPath, require_local
from trainkit.core.warn import warn_user
from trainkit.distributed import ray_train
from trainkit.distributed.atomic import write_text
from trainkit.loop import Position
from trainkit.record.ledger import Bucket

logger = logging.getLogger("trainkit")
#: the goodput journal beside the backups: the last step the run reached and its ledger then
JOURNAL = "goodput.json"


def journal_problem(journal: object) -> str | None:
    """What is wrong with a goodput journal read back (``None``: nothing): each field named.

    >>> journal_problem({"step": "12", "ledger": {}})
    "has step '12', not a whole number"
    """
    if not isinstance(journal, dict):
        return f"holds a JSON {type(journal).__name__}, not an object"
    step = journal.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        return f"has step {step!r}, not a whole number"
    ledger = journal.get("ledger")
    if not isinstance(ledger, dict):
        return "has no ledger object"
    wall = ledger.get("wall_seconds")
    if isinstance(wall, bool) or not isinstance(wall, (int, float)) or not math.isfinite(wall) or wall < 0:
        return f"has ledger.wall_seconds {wall!r}, not a finite number of seconds"
    for field in ("lost_steps", "restarts"):
        value = ledger.get(field, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"has ledger.{field} {value!r}, not a count"
    return None


class BackupAndRestore(Callback):
    """Makes ``fit`` resumable (Keras 3's arguments). When ``backup_dir`` holds a backup, ``fit``
    continues from it exactly: the full ``TrainState`` and the position inside the epoch (so
    the shuffle order too); a resumed run ends with the parameters of an uninterrupted one,
    bit for bit (same device count and strategy). Keras restarts the interrupted epoch.

    Args:
        backup_dir: where the backup lives (an orbax checkpoint directory).
        save_freq: ``"epoch"`` (a backup at every epoch end) or a number of batches (a backup
            every that many optimizer steps, written asynchronously).
        double_checkpoint: keep the previous backup too, and fall back to it when the latest
            cannot be read.
        delete_checkpoint: delete the backup when training completes.

    On SIGTERM the current step finishes, ``on_train_end`` writes a backup (synchronously) and
    ``fit`` raises :class:`trainkit.Preempted` (exit status 143); running the same command again
    resumes. When ``fit`` raises, pending writes are finished and the backup is kept.

    Inside a Ray Train worker, each backup is also Ray's checkpoint (:class:`RayTrainReport`),
    and a ``backup_dir`` without a newer backup first receives Ray's latest checkpoint of a
    folder of the same name (``ray.train.get_checkpoint()``): a worker group on fresh machines
    resumes. Several fits in one ``train_loop_per_worker`` give their backups folders of
    different names.

    The goodput ledger (``history.goodput``) is carried across a resume: each backup records
    it, and ``goodput.json`` beside the backups the last step the run reached (rewritten at
    most every ``journal_seconds``), so a resumed run counts the steps run after the last
    backup as ``lost_steps`` and the time since that backup as ``lost``.
    """

    #: how often (seconds) the goodput journal is rewritten while training (and after each backup)
    journal_seconds: float = 10.0

    async_safe = True  # it saves in on_train_batch_begin, where the live state is the step's
    goodput_bucket = Bucket.CHECKPOINT

    def __init__(
        self,
        backup_dir: LocalPath | None,
        save_freq: str | int = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
    ):
        if not backup_dir:
            raise ValueError(
                f"Empty `backup_dir` argument passed (received {backup_dir!r}): BackupAndRestore needs the "
                "directory that holds the backup, e.g. BackupAndRestore('/tmp/backup')."
            )
        self.backup_dir = require_local(backup_dir, "BackupAndRestore's backup_dir")
        self.save_freq = SaveFrequency(save_freq, "BackupAndRestore")
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        self.checkpointer: Checkpointer | None = None
        self.restored_step: int | None = None
        self._previous_handler: Any = None  # signal.signal's previous handler
        self._journal_due = 0.0  # when the goodput journal is rewritten next (time.monotonic())

    def on_train_begin(self, logs: Logs | None = None) -> None:
        if ray_train.worker_job() is not None:
            ray_train.restore_latest(self.backup_dir)
        foreign = foreign_entries(self.backup_dir)
        if foreign:  # it deletes its backups when the fit completes: another file in their folder is refused
            shown = ", ".join(foreign[:8]) + (f", ... ({len(foreign)} in all)" if len(foreign) > 8 else "")
            raise CheckpointError(
                f"BackupAndRestore({self.backup_dir!r}) holds files it did not write ({shown}). Its backups are "
                "deleted when the fit completes, so it takes a folder of its own: pass an empty or new directory, "
                "e.g. BackupAndRestore('backup')."
            )
        self.checkpointer = Checkpointer(self.backup_dir, max_to_keep=2 if self.double_checkpoint else 1)
        self.restored_step = None
        self._checked = self.model.global_step - 1  # the last step a save was decided for
        steps = sorted(self.checkpointer.steps(), reverse=True)
        set_aside = self.checkpointer.set_aside() if not steps else []
        if set_aside:
            raise CheckpointError(
                f"BackupAndRestore: every backup in {self.backup_dir!r} is corrupt "
                f"({set_aside}), so there is nothing to resume from. Delete the directory "
                "to start afresh (double_checkpoint=True keeps a previous backup to fall back to)."
            )
        for index, step in enumerate(steps):
            self._check_backup(step)
            try:
                manifest = self.model.load(self.checkpointer, step)
            except CheckpointError:
                if index + 1 == len(steps):
                    raise
                logger.warning(
                    "BackupAndRestore: the backup of step %d cannot be read; trying step %d.",
                    step,
                    steps[index + 1],
                    exc_info=True,
                )
                continue
            saved = manifest["position"]  # checked by _check_backup
            self.session.resume_at(
                Position(saved["epoch"], saved["batch"], saved["global_step"]),
                manifest.get("batch_size"),
                data_state=manifest.get("data_state"),
            )
            self.restored_step = self._checked = saved["global_step"]
            self._carry_ledger(manifest, saved["global_step"])
            start = self.session.start
            assert start is not None  # set by resume_at just above
            logger.info(  # routine, as Keras (silent) resumes; logging.getLogger("trainkit") at INFO shows it
                "BackupAndRestore: resuming from step %d (epoch %d, batch %d) in %s.",
                self.restored_step,
                start.epoch,
                start.batch,
                self.backup_dir,
            )
            break
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._journal_due = 0.0

    def _journal_path(self) -> str:
        return os.path.join(self.backup_dir, JOURNAL)

    def _carry_ledger(self, manifest: Manifest, step: int) -> None:
        """The interrupted runs' goodput ledger carried into this one: the backup's, and when the
        journal shows the run went on past it, the steps after it as lost, and the time since it."""
        saved = manifest.get("goodput")
        if not isinstance(saved, dict):  # a backup written before ledgers (or outside fit)
            return
        try:
            with open(self._journal_path()) as f:
                journal = json.load(f)
        except (OSError, ValueError):
            journal = None
        problem = journal_problem(journal)
        if journal is not None and problem is not None:
            warn_user(
                f"BackupAndRestore: {self._journal_path()} {problem}, so the steps run after the backup are not "
                "counted as lost in history.goodput (the resume itself is unaffected); it is rewritten as training "
                "goes on."
            )
            journal = None
        carried = dict(saved, restarts=saved.get("restarts", 0) + 1)
        if isinstance(journal, dict) and journal["step"] >= step:
            last = journal["ledger"]
            lost = max(last["wall_seconds"] - saved["wall_seconds"], 0.0)  # everything done since the backup
            buckets = {**saved["buckets"], Bucket.LOST.value: saved["buckets"].get(Bucket.LOST, 0.0) + lost}
            carried.update(buckets=buckets, wall_seconds=saved["wall_seconds"] + lost)
            carried.update(lost_steps=last.get("lost_steps", 0) + journal["step"] - step)
            carried.update(restarts=last.get("restarts", 0) + 1)
        self.session.ledger.carry(carried)

    def _write_journal(self, force: bool = False) -> None:
        """The step reached and the ledger, beside the backups (main process; at most every
        ``journal_seconds`` unless ``force``)."""
        now = time.monotonic()
        if not distributed.is_main_process() or (now < self._journal_due and not force):
            return
        self._journal_due = now + self.journal_seconds
        record = {"step": self.model.global_step, "ledger": self.session.ledger.saved()}
        write_text(self._journal_path(), json.dumps(record))

    def _open(self) -> Checkpointer:
        if self.checkpointer is None:
            raise RuntimeError("BackupAndRestore has no checkpointer: on_train_begin opens it.")
        return self.checkpointer

    def _check_backup(self, step: int) -> None:
        """Before anything is loaded: a backup holds the whole state (resuming from weights
        alone would restart the optimizer and its schedule while the loop continues at the
        saved step) and a valid position."""
        try:
            manifest = self._open().manifest(step)
        except Exception:  # noqa: BLE001 - unreadable: trainer.load reports it (and falls back)
            return
        if manifest.get("contents") == "weights":
            raise CheckpointError(
                f"BackupAndRestore: {self.backup_dir!r} holds a save_weights_only checkpoint (step {step}), without "
                "the optimizer state, the step count and the data position a resume needs. Give BackupAndRestore a "
                "directory of its own (and ModelCheckpoint another), or load the weights with trainer.load(...)."
            )
        checked_position(manifest, f"the backup of step {step} in {self.backup_dir!r}")

    def _on_sigterm(self, signum, frame) -> None:
        logger.warning("BackupAndRestore: SIGTERM received; finishing the current step, then writing a backup.")
        self.session.preempt()

    def _save(self, wait: bool = False) -> None:
        trainer = self.model
        self._open().save(trainer.global_step, trainer.session.require_state(), trainer.manifest(), wait=wait)
        self._write_journal(force=True)

    @property
    def last_backup(self) -> int | None:
        """The step of the last backup this fit started writing (``None`` before the first)."""
        return self.checkpointer.last_saved if self.checkpointer is not None else None

    def written(self) -> int | None:
        """Waits until the backups started are on disk; returns the step of the last one."""
        if self.checkpointer is None:
            return None
        self.checkpointer.wait()
        return self.checkpointer.last_saved

    def backup_now(self) -> int:
        """Writes a backup of the current step, unless one was already started, and waits until
        it is on disk (a preemption notice's save); returns its step."""
        if self.last_backup != self.model.global_step:
            self._save(wait=True)
        written = self.written()
        assert written is not None  # just saved
        return written

    def execution_cap(self) -> int | None:
        return self.save_freq.period

    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        self._open().poll()  # a failed background write surfaces at once
        step = self.model.global_step  # the live state is at that step
        if self.save_freq.step_due(step, since=self._checked):  # at or after a multiple
            self._save()
        else:
            self._write_journal()
        self._checked = step

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.save_freq.per_epoch:
            self._save()

    def _restore_handler(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def on_train_end(self, logs: Logs | None = None) -> None:
        self._restore_handler()
        if self.session.preempted:
            self._save(wait=True)
            self._open().close()
            logger.warning(
                "BackupAndRestore: backup of step %d written to %s; exiting.", self.model.global_step, self.backup_dir
            )
            return
        self._open().close()
        if self.delete_checkpoint and distributed.is_main_process():
            remove_checkpoints(self.backup_dir)

    def on_exception(self, exception: BaseException) -> None:
        self._restore_handler()
        if self.checkpointer is not None:
            self.checkpointer.close()  # finishes the writes already started; the backup stays
            self._write_journal(force=True)  # the failed run's ledger to the failure: a resume counts what was lost
