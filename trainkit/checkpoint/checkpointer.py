"""Bytes on disk: save and restore a ``TrainState`` with orbax, plus a JSON manifest.

A checkpoint is an orbax step directory holding ``state`` (arrays, via tensorstore) and
``meta`` (JSON: the manifest). Nothing is pickled, so loading a checkpoint cannot run code.
Orbax writes each step into a temporary directory and renames it when complete, so a process
killed mid-save leaves no half-written checkpoint that could be chosen later.

>>> import tempfile, jax.numpy as jnp
>>> from trainkit.core.state import TrainState
>>> state = TrainState.create(params={"w": jnp.ones(3)}, opt_state=(), model_state={}, seed=0)
>>> checkpoints = Checkpointer(tempfile.mkdtemp())
>>> checkpoints.save(0, state, {"position": {"epoch": 0, "batch": 0, "global_step": 0}}, wait=True)
True
>>> restored, manifest = checkpoints.restore(state)
>>> restored.params["w"].tolist(), manifest["position"]["global_step"]
([1.0, 1.0, 1.0], 0)
"""

from __future__ import annotations

import atexit
import concurrent.futures
import errno
import logging
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable

import flax.serialization
import jax
import orbax.checkpoint as ocp

from trainkit import distributed
from trainkit.checkpoint import directory as directory_lib
from trainkit.checkpoint import manifest as manifest_lib
from trainkit.checkpoint import orbax_logs
from trainkit.checkpoint.errors import CheckpointError
from trainkit.checkpoint.parts import Parts
from trainkit.core import state as state_lib
from trainkit.core import tree
from trainkit.core.local_path import LocalPath, require_local
from trainkit.core.tree import PyTree
from trainkit.core.warn import warn_user
from trainkit.distributed import filesystem

logger = logging.getLogger("trainkit")

# A device-side copy of the state, dispatched asynchronously: the next (donating) step may run
# while a background thread moves the copy to the host and orbax writes it.
_snapshot = jax.jit(lambda tree: jax.tree.map(lambda a: a.copy(), tree))

# Every orbax write of the process runs on this one thread, one after another: concurrent saves
# of two CheckpointManagers (e.g. ModelCheckpoint and BackupAndRestore at the same step) were
# seen to deadlock orbax's signalling between its save phases.
_WRITER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainkit-checkpoint")


# Writers still open at interpreter exit finish their writes first (a last resort: fit already
# waits on every exit path). This runs before the thread pools shut down, while orbax can
# still schedule its own work, hence threading's exit hook rather than atexit's. Python 3.12+
# refuses new threads in every exit hook, and orbax needs some: there the write is abandoned
# (orbax renames a step into place only when complete, so nothing half-written is listed) and
# the error says so.
_OPEN_WRITERS: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


def _flush_at_exit() -> None:
    for checkpointer in list(_OPEN_WRITERS):
        try:
            checkpointer.wait()
        except Exception as error:  # noqa: BLE001 - exiting: report, never raise
            logger.error(
                "A checkpoint write to %s still in flight at exit was abandoned (%s); no half-written step is listed. "
                "Call close() (or wait()) on a Checkpointer before the program ends.",
                checkpointer.directory,
                error,
            )


getattr(threading, "_register_atexit", atexit.register)(_flush_at_exit)


def _node_kind(text: str) -> str:
    """orbax's description of one side of a structure mismatch, in words."""
    text = text.strip()
    if text == "MISSING":
        return "nothing"
    if "ValueMetadataEntry" in text or "ArrayMetadata" in text:
        return "an array"
    return "a subtree" if text.startswith("{") or "dict" in text else text


def _structure_mismatch(message: str) -> list[str]:
    """The paths of orbax's "tree structures do not match" error, as ``path: the model has X,
    the checkpoint Y`` (orbax's Source is the item restored into, its Target what is on disk).

    >>> _structure_mismatch("do not match:" + chr(10) + "opt_state.2:" + chr(10) + " - Source: {}" + chr(10)
    ...                     + " - Target: MISSING" + chr(10) + "If this mismatch ...")
    ['opt_state.2: the model has a subtree, the checkpoint nothing']
    """
    if "do not match:" not in message:
        return []
    body = message.split("do not match:", 1)[1].split("If this mismatch", 1)[0]
    found = re.findall(r"^(\S[^\n]*):\n\s*- Source: ([^\n]*)\n\s*- Target: ([^\n]*)", body.strip(), re.M)
    return [
        f"{path}: the model has {_node_kind(mine)}, the checkpoint {_node_kind(disk)}" for path, mine, disk in found
    ]


def check_writable(directory: str) -> None:
    """Raises a :class:`CheckpointError` naming ``directory`` if it cannot be written (4 KiB
    written and synced: a full disk fails too)."""
    problem = filesystem.write_problem(directory, probe_bytes=4096)
    if problem is not None:
        raise CheckpointError(
            f"Cannot write checkpoints to {directory!r}: {problem}. Choose a "
            "writable directory with free space (nothing has been trained or lost yet)."
        )


def _barriers_off_the_devices() -> ocp.options.MultiprocessingOptions:
    """orbax's options with its barriers on the coordination service, not the devices. By default
    orbax synchronises the processes with a device collective (``sync_global_devices``); from
    trainkit's writer thread, while the loop's steps run their own collectives, the processes
    could order the two differently and wait for each other forever (a mid-epoch backup of a
    multi-process run hung at its first save). Naming every process as active makes orbax wait
    at a coordination-service barrier instead, as its ``experimental_orbax_use_distributed_barrier``
    flag would; one process: orbax's defaults."""
    if jax.process_count() == 1:
        return ocp.options.MultiprocessingOptions()
    return ocp.options.MultiprocessingOptions(active_processes=set(range(jax.process_count())))


def _write_error(manager: ocp.CheckpointManager, directory: str, error: Exception) -> CheckpointError:
    """The error a failed write raises: what happened, and the last complete step on disk."""
    try:
        manager.reload()  # what is really on disk, not what orbax meant to write
    except Exception:  # noqa: BLE001 - the error being reported matters more
        pass
    last = manager.latest_step()
    kept = f"the last complete checkpoint is step {last}" if last is not None else "no complete checkpoint exists yet"
    full = any(
        isinstance(cause, OSError) and cause.errno in _FULL for cause in _chain(error)
    ) or "No space left" in str(error)
    fix = "Free disk space" if full else "Check what is in the way in that directory (its permissions, a file there)"
    return CheckpointError(
        f"Writing a checkpoint to {directory!r} failed ({type(error).__name__}: {error}). "
        f"The training state in memory is intact and {kept}. {fix} or choose "
        "another directory, then save again (trainer.save(...))."
    )


#: the errors of a full disk or quota
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and its causes and contexts."""
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _check_nothing_in_the_way(directory: str, step: int) -> None:
    """Refuses to write step ``step`` where its path already holds what orbax did not write as a
    step (a symbolic link, a file, a folder without a step's metadata): the write would fail half-way
    or go through the link."""
    path = os.path.join(directory, str(step))
    if not os.path.lexists(path):
        return
    if os.path.islink(path):
        what = f"a symbolic link to {os.path.realpath(path)}"
    elif not os.path.isdir(path):
        what = "a file"
    else:
        return  # a folder: orbax's own (a step it lists, or its partial write, which it replaces)
    raise CheckpointError(
        f"Step {step} would be written at {path}, which is already there as {what}, not a checkpoint. Nothing was "
        "written; the training state in memory is intact. Remove it, or choose another directory."
    )


class Checkpointer:
    """An orbax ``CheckpointManager`` over one directory, for ``TrainState`` + manifest.

    Args:
        directory: where the step directories go (created if missing).
        max_to_keep: how many checkpoints to keep (``None``: all).
        best_fn: maps a step's ``metrics`` dict to a number; with it, the *best* ``max_to_keep``
            are kept instead of the latest.
        best_mode: ``"min"`` or ``"max"`` for ``best_fn``.
        enable_async: return from ``save`` at once: the state is copied on its devices (an
            asynchronous dispatch that costs one state's worth of device memory until it is on
            the host), and trainkit's checkpoint thread writes the copy with orbax. At most one
            write is in flight: the next ``save`` waits for it (and raises its error).
        read_only: open to read (``load``, a restore): no write probe, no lock, nothing created;
            works on a read-only or full file system.

    A writer takes a lock on the directory (``.trainkit-lock``, held while open, on process
    0): a second writer, in this process or another, gets a :class:`CheckpointError` naming the
    holder instead of interleaving its steps with the first one's.
    """

    def __init__(
        self,
        directory: LocalPath,
        *,
        max_to_keep: int | None = None,
        best_fn: Callable[[dict[str, float]], float] | None = None,
        best_mode: str = "min",
        enable_async: bool = True,
        read_only: bool = False,
    ):
        self.directory = os.path.abspath(require_local(directory, "The checkpoint directory"))
        self.read_only = read_only
        self._lock = self._alias = None
        orbax_logs.install()  # a write failing in orbax's threads: one CheckpointError, its tracebacks at DEBUG
        if read_only:
            if not os.path.isdir(self.directory):
                raise CheckpointError(f"No checkpoint directory {self.directory!r}.")
        else:
            check_writable(self.directory)
            self._lock = directory_lib.lock_directory(self.directory)
        directory_lib.set_aside_unreadable_steps(self.directory, read_only)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            best_fn=best_fn,
            best_mode=best_mode,
            keep_checkpoints_without_metrics=False if best_fn else True,
            enable_async_checkpointing=False,  # trainkit's writer thread is the async part
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
            # with several processes check_writable has made it: orbax refuses `create` with active_processes
            create=not read_only and jax.process_count() == 1,
            **({"save_interval_steps": 0} if read_only else {}),
            multiprocessing_options=_barriers_off_the_devices(),
        )
        try:
            self._alias = directory_lib.glob_free_alias(self.directory)
            with orbax_logs.without_read_only_notice():  # orbax warns that a directory opened to read is read only
                self._manager = ocp.CheckpointManager(self._alias or self.directory, options=options)
        except BaseException:
            directory_lib.remove_alias(self._alias)
            directory_lib.unlock(self._lock)
            raise
        self._last_saved: int | None = None
        self.enable_async = enable_async
        self._pending: list[concurrent.futures.Future[None]] = []
        if not read_only:
            _OPEN_WRITERS.add(self)

    # ----------------------------------------------------------------- writing
    def save(
        self,
        step: int,
        state: PyTree,
        manifest: manifest_lib.Manifest,
        *,
        metrics: dict[str, float] | None = None,
        wait: bool = False,
        weights_only: bool = False,
        overwrite: bool = False,
        allow_non_finite: bool = False,
    ) -> bool:
        """Starts writing ``state`` at ``step`` and returns ``True``; returns ``False`` (and
        writes nothing) for a step already saved, unless ``overwrite``, and, with a warning,
        for parameters that are not all finite, unless ``allow_non_finite``. ``weights_only``
        writes the variables (``params`` and ``model_state``) without the optimizer state, step
        and rng; :meth:`restore` then replaces only those."""
        if self.read_only:
            raise CheckpointError(f"{self.directory!r} was opened read-only; open it again to save.")
        self._collect_errors(block=True)  # at most one write in flight; its error surfaces here
        _check_nothing_in_the_way(self.directory, int(step))
        if step == self._last_saved or step in self.steps():
            if not overwrite:
                return False
            self.wait()
            if step in self.steps():
                self._manager.delete(int(step))
        if not allow_non_finite and not all_finite(state.params):
            warn_user(
                f"Not saving step {step} to {self.directory!r}: its parameters are not all finite (NaN or inf). "
                "The last finite checkpoint is kept."
            )
            return False
        self._last_saved = int(step)
        # DataParallel's state on several processes is pmap's per-process replicas: one global array each
        state_dict = _present(flax.serialization.to_state_dict(distributed.global_replicas(state)))
        state_dict, manifest = Parts.written_as(manifest, weights_only).written(state_dict, manifest)
        if self.enable_async:
            state_dict = _snapshot(state_dict)
        self._pending.append(_WRITER.submit(self._write, step, state_dict, manifest, metrics))
        if wait or not self.enable_async:
            self.wait()
        return True

    def _write(self, step, state_dict, manifest, metrics) -> None:
        try:
            self._manager.save(
                int(step),
                args=ocp.args.Composite(state=ocp.args.StandardSave(state_dict), meta=ocp.args.JsonSave(manifest)),
                metrics=metrics,
                force=True,
            )
        except Exception as error:  # orbax and tensorstore raise many kinds
            try:  # orbax's own threads done with the step's folder first: one still writing recreated it under load
                self._manager.wait_until_finished()
            except Exception:  # noqa: BLE001 - the same failed write, raised below
                pass
            directory_lib.remove_partial_write(self.directory, int(step))
            raise _write_error(self._manager, self.directory, error) from error

    def _collect_errors(self, block: bool = False) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            if block or future.done():
                future.result()  # raises the CheckpointError of a failed write
            else:
                self._pending.append(future)

    def poll(self) -> None:
        """Raises the :class:`CheckpointError` of a background write that failed (never blocks)."""
        if self._pending:
            self._collect_errors()

    def wait(self) -> None:
        """Blocks until every started write is on disk."""
        self._collect_errors(block=True)
        try:
            self._manager.wait_until_finished()
        except Exception as error:
            raise _write_error(self._manager, self.directory, error) from error

    # ----------------------------------------------------------------- reading
    def steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def set_aside(self) -> list[str]:
        """The corrupt steps moved aside when a writer opened the directory (``<step>.unreadable``)."""
        return sorted(name for name in os.listdir(self.directory) if name.endswith(directory_lib.SET_ASIDE))

    @property
    def last_saved(self) -> int | None:
        """The step this object last started writing, if any."""
        return self._last_saved

    def delete(self, step: int) -> None:
        """Removes the checkpoint of ``step`` (refused for a link or file at its path: trainkit
        removes only what it wrote)."""
        _check_nothing_in_the_way(self.directory, int(step))
        self._manager.delete(step)

    def latest_step(self) -> int | None:
        latest: int | None = self._manager.latest_step()
        return latest

    def verified_steps(self) -> list[int]:
        """The steps, newest first, whose manifest reads back and whose array files are all
        present (orbax's metadata lists them); a corrupt step is left out with a warning."""
        good = []
        for step in sorted(self.steps(), reverse=True):
            problem = directory_lib.unreadable_reason(self.directory, step)
            if problem is None:
                good.append(step)
            else:
                warn_user(f"Skipping checkpoint step {step} in {self.directory!r}: {problem}")
        return good

    def best_step(self) -> int | None:
        best: int | None = self._manager.best_step()
        return best

    def manifest(self, step: int | None = None) -> manifest_lib.Manifest:
        step = self._resolve(step)
        manifest: manifest_lib.Manifest = self._manager.restore(
            step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        )["meta"]
        return manifest

    def _resolve(self, step: int | None) -> int:
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"No complete checkpoint in {self.directory!r}.")
        if step is None:
            return max(steps)
        if step not in steps:
            raise CheckpointError(
                f"No checkpoint for step {step} in {self.directory!r}; available steps: {sorted(steps)}."
            )
        return step

    def restore(self, target: PyTree, step: int | None = None) -> tuple[PyTree, manifest_lib.Manifest]:
        """Restores into the structure, shapes and shardings of ``target`` (a state of arrays
        or ``jax.ShapeDtypeStruct``s); raises a :class:`CheckpointError` naming every path
        whose shape or dtype differs. Without ``step``, the newest checkpoint that reads back
        completely: a corrupt newer one is skipped with a warning naming it and why."""
        if step is not None:
            return self._restore(target, self._resolve(step))
        candidates = self.verified_steps()
        if not candidates:
            self._resolve(None)  # raises "no complete checkpoint" when there is none
        errors = []
        for candidate in candidates:
            try:
                return self._restore(target, candidate)
            except CheckpointError as error:
                if any(reason in str(error) for reason in ("does not match this model", "other base weights", "LoRA")):
                    raise
                errors.append(str(error))
                warn_user(f"Skipping checkpoint step {candidate}: {error}")
        raise CheckpointError(
            f"No checkpoint in {self.directory!r} reads back: " + " | ".join(errors or ["every step is corrupt"])
        )

    def _restore(self, target: PyTree, step: int) -> tuple[PyTree, manifest_lib.Manifest]:
        try:
            manifest = self.manifest(step)
        except Exception as error:  # noqa: BLE001 - orbax and json raise many kinds
            raise CheckpointError(
                f"The manifest of step {step} in {self.directory!r} is unreadable ({type(error).__name__}: {error})."
            ) from error
        policy = Parts.of(manifest)
        policy.check(manifest, target, f"step {step} in {self.directory!r}")
        problems, parts = [], policy.stored(flax.serialization.to_state_dict(target))
        for part in ("params", "opt_state", "model_state"):
            if part in manifest.get("tree", {}):
                current = tree.signature(parts[part])
                problems += tree.difference(part, manifest["tree"][part], current, names=("checkpoint", "model"))
        if problems:
            raise CheckpointError(
                f"The checkpoint at step {step} in {self.directory!r} does not match this "
                f"model and optimizer: "
                + "; ".join(problems[:12])
                + (f" (and {len(problems) - 12} more)" if len(problems) > 12 else "")
                + ". "
                + manifest_lib.older_layout(manifest)
                + "Restore with the model and optimizer that wrote it."
            )
        target_dict = policy.read(_present(parts))  # a part that is None (no spike skip) is not written, nor read
        abstract = state_lib.abstract(target_dict)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))[
                "state"
            ]
        except Exception as error:  # noqa: BLE001 - tensorstore DATA_LOSS, KeyError, ValueError...
            mismatch = _structure_mismatch(str(error))
            if mismatch:  # a valid checkpoint of another optimizer or precision policy
                raise CheckpointError(
                    f"The checkpoint at step {step} in {self.directory!r} does not match this model and optimizer: "
                    f"the state's structure differs ({'; '.join(mismatch[:12])}). {manifest_lib.older_layout(manifest)}"
                    "The optimizer (adam against "
                    "adamw, a chain of another length), the precision policy (fp16 keeps a loss scale) or skip_spikes "
                    "(a running average) is not the one that wrote it: restore with the same optimizer, precision "
                    "and skip_spikes, or save_weights_only checkpoints to move weights between them."
                ) from error
            _let_late_reads_finish()
            raise CheckpointError(
                f"The arrays of step {step} in {os.path.join(self.directory, str(step), 'state')!r} are corrupt or "
                f"incomplete ({type(error).__name__}: {str(error)[:300]})."
            ) from error
        restored = policy.restored(restored, flax.serialization.to_state_dict(target))
        if not policy.weights_only and "position" in manifest:  # a whole state: its step is the manifest's
            where = f"step {step} in {self.directory!r}"
            written = manifest_lib.checked_position(manifest, where)["global_step"]
            if int(restored["step"]) != written:
                raise CheckpointError(
                    f"The arrays of {where} hold the state of step {int(restored['step'])}, but its manifest says "
                    f"step {written}: the directory mixes files of different saves. Resume from another step."
                )
        restored = {**{part: None for part, value in parts.items() if value is None}, **restored}
        return flax.serialization.from_state_dict(target, restored), manifest

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Finishes the writes started (a writer) and releases orbax's manager and the lock;
        ``with Checkpointer(...) as checkpoints:`` closes on leaving the block."""
        try:
            if not self.read_only:
                self.wait()
        finally:
            try:
                self._manager.close()
            finally:
                directory_lib.remove_alias(self._alias)
                directory_lib.unlock(self._lock)
                self._lock = self._alias = None


_all_finite_jit = jax.jit(
    lambda tree: jax.numpy.all(
        jax.numpy.stack(
            [
                jax.numpy.all(jax.numpy.isfinite(a))
                for a in jax.tree.leaves(tree)
                if jax.numpy.issubdtype(a.dtype, jax.numpy.inexact)
            ]
            or [jax.numpy.array(True)]
        )
    )
)


def _present(state_dict: manifest_lib.StateDict) -> manifest_lib.StateDict:
    """The parts of a state's dict that hold something: a part that is ``None`` (the spike
    average of a trainer without ``skip_spikes``) is neither written nor read, so checkpoints
    written before that part existed read back."""
    return {part: value for part, value in state_dict.items() if value is not None}


def all_finite(tree: PyTree) -> bool:
    """Whether every floating leaf of ``tree`` is finite (one reduction on the devices)."""
    return bool(_all_finite_jit(tree))


#: A failed restore waits for the reads it left running until none has reported for
#: ``LATE_READS_QUIET`` seconds, at most ``LATE_READS_SECONDS`` (see :func:`_let_late_reads_finish`).
LATE_READS_QUIET, LATE_READS_SECONDS = 0.5, 5.0


def _let_late_reads_finish() -> None:
    """When one array of an orbax restore fails to read, orbax's event loop closes while
    tensorstore still completes the other reads; each completion then reports to the closed
    loop, a ``RuntimeError('Event loop is closed')`` printed as an ignored exception, noise
    about a failure already raised. Waits for them with exactly that error silenced, until
    they have been quiet for a while."""
    previous = sys.unraisablehook
    last = [time.monotonic()]

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            last[0] = time.monotonic()
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    deadline = time.monotonic() + LATE_READS_SECONDS
    try:
        while time.monotonic() < deadline and time.monotonic() - last[0] < LATE_READS_QUIET:
            time.sleep(0.05)
    finally:
        sys.unraisablehook = previous


#: Orbax's per-step record (its commit time), read for every step when a manager opens.
