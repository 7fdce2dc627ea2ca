"""One checkpoint written or read in the foreground: what ``Trainer.save`` and ``Trainer.load``
do (:func:`save_session`, :func:`restore_session`), on a directory or an open
:class:`~trainkit.checkpoint.Checkpointer`.

>>> import tempfile, jax.numpy as jnp
>>> from trainkit.core.state import TrainState
>>> state = TrainState.create(params={"w": jnp.ones(2)}, opt_state=(), model_state={}, seed=0)
>>> directory = tempfile.mkdtemp()
>>> save(directory, 0, state, {"position": {"epoch": 0, "batch": 0, "global_step": 0}})
>>> restored, manifest = restore(directory, state)
>>> restored.params["w"].tolist(), manifest["position"]["global_step"]
([1.0, 1.0], 0)
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any, TypedDict

from trainkit.checkpoint import directory as directory_lib
from trainkit.checkpoint.checkpointer import Checkpointer, CheckpointError, all_finite
from trainkit.checkpoint.manifest import Layout, Manifest, explain_restore
from trainkit.core.local_path import LocalPath
from trainkit.core.tree import PyTree
from trainkit.core.warn import warn_user
from trainkit.distributed import atomic
from trainkit.record.session import Session


def save(
    filepath: LocalPath,
    step: int,
    state: PyTree,
    manifest: Manifest,
    *,
    max_to_keep: int | None = None,
    weights_only: bool = False,
    overwrite: bool = True,
    allow_non_finite: bool = False,
) -> None:
    """Writes ``state`` (or only its variables) and ``manifest`` at ``step`` and waits until it
    is on disk; refuses an existing step unless ``overwrite`` and non-finite parameters unless
    ``allow_non_finite``, writing nothing then."""
    checkpointer = Checkpointer(filepath, max_to_keep=max_to_keep, enable_async=False)
    try:
        if not overwrite and step in checkpointer.steps():
            raise CheckpointError(
                f"{checkpointer.directory!r} already holds step {step}; pass overwrite=True to replace it."
            )
        if not allow_non_finite and not all_finite(state.params):
            raise CheckpointError(
                f"The parameters at step {step} are not all finite (NaN or inf); nothing was written to "
                f"{checkpointer.directory!r}. Pass allow_non_finite=True to save them anyway (for debugging)."
            )
        checkpointer.save(
            step, state, manifest, wait=True, weights_only=weights_only, overwrite=True, allow_non_finite=True
        )
    finally:
        checkpointer.close()


def restore(directory: LocalPath | Checkpointer, target: PyTree, step: int | None = None) -> tuple[PyTree, Manifest]:
    """The checkpoint's state (the latest, or ``step``) in the shardings of ``target``, and its
    manifest; a directory is opened read-only and closed again."""
    own = not isinstance(directory, Checkpointer)
    checkpointer = directory if isinstance(directory, Checkpointer) else Checkpointer(directory, read_only=True)
    try:
        return checkpointer.restore(target, step)
    finally:
        if own:
            checkpointer.close()


class SaveOptions(TypedDict, total=False):
    """``Trainer.save``'s options (:func:`save_session`'s defaults)."""

    max_to_keep: int | None
    weights_only: bool
    overwrite: bool
    allow_non_finite: bool


def save_session(
    filepath: LocalPath,
    session: Session,
    manifest: Manifest,
    *,
    max_to_keep: int | None = None,
    weights_only: bool = False,
    overwrite: bool = True,
    allow_non_finite: bool = False,
) -> int:
    """:func:`save` of ``session``'s live state at its step (``Trainer.save``), which it returns."""
    step = session.position.step
    save(
        filepath, step, session.require_state(), manifest, max_to_keep=max_to_keep, weights_only=weights_only,
        overwrite=overwrite, allow_non_finite=allow_non_finite,
    )  # fmt: skip
    return step


def restore_session(
    directory: LocalPath | Checkpointer, session: Session, step: int | None, into: Layout | None
) -> dict[str, Any]:
    """:func:`restore` into ``session``'s live state (``Trainer.load``), in its shardings: the
    position follows a full checkpoint, not a weights-only one; returns the manifest (and warns
    where the checkpoint's strategy or batch size differ from ``into`` and the session's)."""
    state, manifest = restore(directory, session.require_state(), step)
    session.replace_state(state, moves_position=manifest.get("contents") != "weights")
    explain_restore(manifest, into, session.batch_size)
    return manifest


def remove_checkpoints(directory: LocalPath) -> None:
    """Deletes what trainkit wrote in a checkpoint directory (its steps, its lock, the goodput
    journal), never another file, and the directory itself when that leaves it empty (never the
    working directory or one above it). Through a symbolic link, what the link points to is
    emptied of them and the link kept (``rmtree`` refuses links, which left a finished run's
    backup to be "resumed" by the next one). A file that cannot be deleted is warned about.

    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()); (target / "7").mkdir(); _ = (target / "notes.txt").write_text("mine")
    >>> link = target.parent / (target.name + "-link"); link.symlink_to(target)
    >>> remove_checkpoints(link); link.is_symlink(), [p.name for p in target.iterdir()]
    (True, ['notes.txt'])
    """
    failures: list[str] = []

    def failed(function, path, error) -> None:
        failures.append(f"{path} ({error[1] if isinstance(error, tuple) else error})")

    on_error: dict[str, Any] = {
        "onexc" if sys.version_info >= (3, 12) else "onerror": failed
    }  # onerror is deprecated in 3.12
    path = os.fspath(directory)
    folder = os.path.realpath(path)
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        entry = os.path.join(folder, name)
        if not directory_lib.written_by_trainkit(name):
            continue  # the user's: kept
        if os.path.isdir(entry) and not os.path.islink(entry):
            shutil.rmtree(entry, **on_error)
        else:
            try:
                os.remove(entry)
            except OSError as error:
                failures.append(f"{entry} ({error})")
    keep_folder = os.path.islink(path) or atomic.holds_working_directory(folder)
    if not keep_folder and os.path.isdir(folder) and not os.listdir(folder):
        try:
            os.rmdir(folder)
        except OSError as error:
            failures.append(f"{folder} ({error})")
    if failures:
        warn_user(
            f"Could not delete all of {path!r}: {'; '.join(failures[:5])}. A later run given this directory would find "
            "these files: delete them by hand."
        )
