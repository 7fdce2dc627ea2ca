"""``RayTrainReport``: a fit inside a Ray Train worker reports to Ray (as Ray's own
``RayTrainReportCallback`` does for Lightning): every epoch's metrics, ``BackupAndRestore``'s
backups as Ray's checkpoints, and a backup when Ray announces that a node is being reclaimed.
``fit`` adds it in a Ray Train worker; outside one it refuses to start.

>>> report = RayTrainReport(check_seconds=10)
>>> report.check_seconds, report.backup is None
(10, True)
"""

from __future__ import annotations

import logging
import numbers
import time

from trainkit.callbacks.backup_and_restore import BackupAndRestore
from trainkit.callbacks.base import Callback, Logs
from trainkit.distributed import ray_train

logger = logging.getLogger("trainkit")


class RayTrainReport(Callback):
    """Reports a ``fit`` inside Ray Train's ``train_loop_per_worker`` to Ray.

    - At every epoch end, ``ray.train.report`` of the epoch's logs with ``epoch`` (Keras's
      0-based index) and ``step`` (the optimizer step): Ray's ``Result.metrics``.
    - Each backup the fit's :class:`BackupAndRestore` writes becomes Ray's checkpoint
      (``trainkit-<backup folder>-step-<step>``, in ``RunConfig(storage_path=...)``); a worker
      group that Ray restarts on fresh machines resumes from it (``BackupAndRestore`` copies
      ``ray.train.get_checkpoint()`` into its folder first).
    - When Ray announces a preemption (``ray.train.get_preemption_info()``, asked about every
      ``check_seconds``), ``BackupAndRestore`` writes a backup at once and it is reported; the
      fit goes on, as Ray advises, and Ray restarts from that checkpoint once the node is gone.

    Args:
        check_seconds: how often Ray is asked for a preemption notice (Ray's watcher looks every
            5 s); process 0's clock decides, every worker asks at the same step.
        backup: the ``BackupAndRestore`` whose backups are reported; ``fit`` attaches the one in
            its callbacks.

    Each report is a barrier of Ray's workers; a backup is on disk before it is reported (the
    write is waited for), and Ray copies it to its storage.
    """

    async_safe = True  # its batch hook reads only the step count and BackupAndRestore's last write

    def __init__(self, check_seconds: float = 5.0, backup: BackupAndRestore | None = None):
        if isinstance(check_seconds, bool) or not isinstance(check_seconds, numbers.Real) or not check_seconds >= 0:
            raise ValueError(
                f"RayTrainReport(check_seconds=...) must be a number of seconds >= 0; received {check_seconds!r}."
            )
        self.check_seconds: float = check_seconds
        self.backup: BackupAndRestore | None = backup
        self._reported: int = -1  # the last backup step reported
        self._epoch: int = 0
        self._next_check: int = 0  # the step at which Ray is asked for a preemption notice next
        self._checked_at: tuple[int, float] = (0, 0.0)  # the step and time (process 0) of the last question
        self._noticed: bool = False

    def on_train_begin(self, logs: Logs | None = None) -> None:
        if ray_train.worker_job() is None:
            raise RuntimeError(
                "RayTrainReport reports to Ray Train, but this fit does not run inside a Ray Train worker "
                "(train_loop_per_worker of ray.train.v2.jax.JaxTrainer). Remove it; inside a worker fit adds it."
            )
        self._reported = -1  # a backup restored from is not reported again: only those written from now on
        self._noticed = False
        self._next_check = self.model.global_step
        self._checked_at = (self.model.global_step, time.monotonic())

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._epoch = epoch

    def _metrics(self, logs: Logs | None) -> dict[str, float]:
        numbers_only = {k: float(v) for k, v in (logs or {}).items() if isinstance(v, numbers.Real)}
        return numbers_only | {"epoch": self._epoch, "step": self.model.global_step}

    def _report(self, logs: Logs | None, always: bool) -> None:
        """Reports the backup written since the last report, if any (with ``logs``); else, when
        ``always``, the metrics alone."""
        started = self.backup.last_backup if self.backup is not None else None  # no wait unless a new one
        if self.backup is not None and started is not None and started > self._reported:
            step = self.backup.written()  # on disk before Ray copies it
            assert step is not None  # one was started
            ray_train.report(self._metrics(logs), self.backup.backup_dir, step)
            self._reported = step
        elif always:
            ray_train.report(self._metrics(logs))

    def _ask_for_notice(self) -> None:
        """Asks Ray whether a node is being reclaimed; on the first notice, a backup now. The
        next question's step: process 0's steps per ``check_seconds``, shared."""
        step, now = self.model.global_step, time.monotonic()
        if ray_train.preemption_notice() and not self._noticed and self.backup is not None:
            self._noticed = True
            logger.warning("RayTrainReport: Ray announced a preemption; writing a backup of step %d.", step)
            self.backup.backup_now()
        last_step, last_time = self._checked_at
        per_second = (step - last_step) / max(now - last_time, 1e-9)
        ahead = max(1, int(per_second * self.check_seconds)) if step > last_step else 1
        self._next_check = int(ray_train.shared(step + ahead))
        self._checked_at = (step, now)

    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        if self.backup is not None and self.model.global_step >= self._next_check:
            self._ask_for_notice()
        self._report(logs, always=False)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        self._report(logs, always=True)

    def on_train_end(self, logs: Logs | None = None) -> None:
        self._report(logs, always=False)  # a backup written as the fit stopped (SIGTERM)
