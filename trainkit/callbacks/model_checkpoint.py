"""``ModelCheckpoint``: save the model at epoch ends or every N batches (Keras 3's semantics),
as orbax checkpoints that ``trainer.load`` reads.

>>> import tempfile
>>> checkpoint = ModelCheckpoint(tempfile.mkdtemp() + "/ckpt-{epoch:02d}-{val_loss:.2f}", save_best_only=True)
>>> checkpoint.mode, checkpoint._get_file_path(0, None, {"val_loss": 0.5}).rsplit("/", 1)[1]
('min', 'ckpt-01-0.50')
"""

from __future__ import annotations

import logging
import math
import os

from trainkit import distributed
from trainkit.callbacks.base import Logs, MonitorCallback
from trainkit.callbacks.triggers import SaveFrequency
from trainkit.checkpoint import Checkpointer, check_writable, remove_checkpoints
from trainkit.core.local_path import LocalPath, require_local
from trainkit.core.warn import warn_user
from trainkit.record.ledger import Bucket

logger = logging.getLogger("trainkit")


class ModelCheckpoint(MonitorCallback):
    """Saves the training state (or only the variables) to ``filepath`` (Keras 3's arguments).

    ``filepath`` is formatted like Keras's: ``epoch`` (from 1), ``batch`` (from 1, with an
    integer ``save_freq``) and every logged value, e.g. ``"ckpt-{epoch:02d}-{val_loss:.2f}"``,
    which keeps one checkpoint per epoch; a fixed path is replaced at every save, so it holds
    the latest (or, with ``save_best_only``, the best) model. Each path is an orbax checkpoint
    directory; ``trainer.load(path)`` restores it. A ``.keras`` or ``.weights.h5`` ending is
    kept as part of the directory name.

    Args:
        filepath: the (template of the) checkpoint directory.
        monitor: the logged name that ``save_best_only`` ranks by.
        verbose: 1 prints a line per save decision, as Keras does.
        save_best_only: save only when ``monitor`` improves on the best so far (a missing
            ``monitor`` warns and saves, as Keras does).
        save_weights_only: write the variables (parameters and model state) only, without the
            optimizer state; ``trainer.load`` then replaces only the variables.
        mode: ``"min"``, ``"max"`` or ``"auto"`` for ``monitor``.
        save_freq: ``"epoch"`` or a number of batches.
        initial_value_threshold: the best value to beat at the start (``save_best_only``).
        max_to_keep: trainkit's retention limit: how many checkpoints a fixed path keeps
            (default 1) or how many formatted paths stay on disk (default: all), oldest removed.

    A step whose loss is NaN or infinite is never saved. With an integer ``save_freq`` the
    loop waits for each batch (``on_train_batch_end(i)`` sees the state after batch ``i``); with
    ``"epoch"`` it is ``async_safe``.
    """

    goodput_bucket = Bucket.CHECKPOINT

    def __init__(
        self,
        filepath: LocalPath,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        initial_value_threshold: float | None = None,
        *,
        max_to_keep: int | None = None,
    ):
        super().__init__(monitor, mode, baseline=initial_value_threshold)
        self.filepath = require_local(filepath, "ModelCheckpoint's filepath")
        self.verbose = verbose
        self.save_best_only = save_best_only
        self.save_weights_only = save_weights_only
        frequency = SaveFrequency(save_freq, "ModelCheckpoint")
        self.save_freq, self._period = frequency.value, frequency.period
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be a positive integer or None; received {max_to_keep!r}.")
        self.max_to_keep = max_to_keep
        self.async_safe = save_freq == "epoch"
        self._templated = "{" in self.filepath or "}" in self.filepath
        self._batches_seen_since_last_saving = 0
        self._last_batch_seen: int | None = None
        self._current_epoch = 0
        self._open: dict[str, Checkpointer] = {}
        self.saved_paths: list[str] = []  # formatted paths written, oldest first

    # ------------------------------------------------------------------ Keras's decisions
    def on_train_begin(self, logs: Logs | None = None) -> None:
        if self._templated:  # fails now, not after an epoch, when the directory is unusable
            self._check_template()
            check_writable(os.path.dirname(self.filepath.split("{", 1)[0]) or ".")
        else:
            self._checkpointer(self.filepath)

    def _check_template(self) -> None:
        """The filepath's fields, before the first step: positional fields and broken braces can
        never format (an error); a name the logs will not hold (the loop's ``logged_names``, ``epoch``,
        ``batch``, the ``learning_rate`` Keras's learning-rate callbacks add) is warned about, as
        a callback may still add it (Keras formats whatever the logs hold at the save)."""
        import string

        logged = self.session.logged_names if self.trainer is not None else None
        known = {"epoch", "batch", "learning_rate", *(logged or ())}
        try:
            fields = [field for _, field, _, _ in string.Formatter().parse(self.filepath) if field is not None]
        except ValueError as error:
            raise ValueError(f'ModelCheckpoint filepath "{self.filepath}" is not a valid template: {error}.') from None
        for field in fields:
            name = field.split(".")[0].split("[")[0]
            if not name or name.isdigit():
                raise ValueError(
                    f'ModelCheckpoint filepath "{self.filepath}" has a positional field {{{field}}}: name what it '
                    "holds, {epoch}, {batch} or a logged metric such as {val_loss:.2f}."
                )
            if logged is not None and name not in known:  # a callback may still add it, as in Keras
                warn_user(
                    f'ModelCheckpoint filepath "{self.filepath}" names {{{name}}}, which fit does not log: the logs '
                    f"hold {sorted(known)} (validation metrics need validation_data). Unless a callback before this "
                    "one adds it to the logs, the first save will fail with a KeyError: fix the name now."
                )

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        for checkpointer in self._open.values():  # a failed background write surfaces at once
            checkpointer.poll()

    def reads_batch_logs(self) -> bool:
        return self.save_freq != "epoch"

    def execution_cap(self) -> int | None:
        return self._period

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if self._should_save_on_batch(batch):
            self._save_model(self._current_epoch, batch, logs)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.save_freq == "epoch":
            self._save_model(epoch, None, logs)

    def _should_save_on_batch(self, batch: int) -> bool:
        if self.save_freq == "epoch":
            return False
        if self._last_batch_seen is None or batch <= self._last_batch_seen:
            add = batch + 1  # a new epoch
        else:
            add = batch - self._last_batch_seen
        self._batches_seen_since_last_saving += add
        self._last_batch_seen = batch
        if self._period is not None and self._batches_seen_since_last_saving >= self._period:
            self._batches_seen_since_last_saving = 0
            return True
        return False

    def _should_save_model(self, epoch: int, logs: Logs, filepath: str) -> bool:
        if not self.save_best_only:
            if self.verbose > 0:
                print(f"\nEpoch {epoch + 1}: saving model to {filepath}")
            return True
        current = logs.get(self.monitor)
        if current is None:
            warn_user(f"Can save best model only with {self.monitor} available.")
            return True
        best = "None" if self.best is None else f"{self.best:.5f}"
        if self._is_improvement(current, self.best):
            if self.verbose > 0:
                print(
                    f"\nEpoch {epoch + 1}: {self.monitor} improved from {best} to {current:.5f}, "
                    f"saving model to {filepath}"
                )
            self.best = current
            return True
        if self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: {self.monitor} did not improve from {best}")
        return False

    def _get_file_path(self, epoch: int, batch: int | None, logs: Logs | None) -> str:
        logs = logs or {}
        try:
            if batch is None or "batch" in logs:
                return self.filepath.format(epoch=epoch + 1, **logs)
            return self.filepath.format(epoch=epoch + 1, batch=batch + 1, **logs)
        except KeyError as error:
            raise KeyError(
                f'Failed to format this callback filepath: "{self.filepath}". Reason: {error}. The logged '
                f"names are {sorted(logs)} (validation metrics need validation_data)."
            ) from None

    def _save_model(self, epoch: int, batch: int | None, logs: Logs | None) -> None:
        logs = logs or {}
        filepath = self._get_file_path(epoch, batch, logs)
        loss = logs.get("loss")
        if loss is not None and not math.isfinite(loss):
            warn_user(
                f"ModelCheckpoint: not saving step {self.model.global_step} to {filepath}: the loss is "
                f"{loss}. The last good checkpoint stays."
            )
            return
        if self._should_save_model(epoch, logs, filepath):
            self._write(filepath)

    # ------------------------------------------------------------------ bytes on disk
    def _checkpointer(self, filepath: str) -> Checkpointer:
        if filepath not in self._open:
            keep = (self.max_to_keep or 1) if not self._templated else 1
            self._open[filepath] = Checkpointer(filepath, max_to_keep=keep)
        return self._open[filepath]

    def _write(self, filepath: str) -> None:
        trainer = self.model
        checkpointer = self._checkpointer(filepath)
        step = trainer.global_step
        stale = [s for s in checkpointer.steps() if s > step or (s == step and checkpointer.last_saved != step)]
        if stale:  # from an earlier run and not older: replaced, as Keras overwrites the file
            logger.warning("ModelCheckpoint: replacing the checkpoint(s) of step(s) %s in %s.", stale, filepath)
            for old in stale:
                checkpointer.delete(old)
        checkpointer.save(
            step, trainer.session.require_state(), trainer.manifest(), weights_only=self.save_weights_only
        )
        if not self._templated:
            return
        if filepath in self.saved_paths:
            self.saved_paths.remove(filepath)
        self.saved_paths.append(filepath)
        for older in list(self._open)[:-2]:  # older formatted paths: finish their writes
            self._open.pop(older).close()
        if self.max_to_keep is not None:
            while len(self.saved_paths) > self.max_to_keep:
                oldest = self.saved_paths.pop(0)
                if oldest in self._open:
                    self._open.pop(oldest).close()
                if distributed.is_main_process():
                    remove_checkpoints(oldest)

    def wait(self) -> None:
        """Blocks until every checkpoint started so far is on disk."""
        for checkpointer in self._open.values():
            checkpointer.wait()

    def _close(self) -> None:
        open_checkpointers, self._open = self._open, {}
        for checkpointer in open_checkpointers.values():
            checkpointer.close()

    def on_train_end(self, logs: Logs | None = None) -> None:
        self._close()

    def on_exception(self, exception: BaseException) -> None:
        self._close()  # the writes already started are finished
