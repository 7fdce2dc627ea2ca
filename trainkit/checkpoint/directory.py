"""A checkpoint directory's handling around orbax: one writer at a time (a lock file), a path
orbax would read as a glob pattern (a symbolic link without the characters), and step
directories whose orbax record is corrupt (set aside, so the other steps open), steps that do
not read back, and what a failed write left behind.

>>> import tempfile
>>> unreadable_steps(tempfile.mkdtemp())
[]
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import time
from typing import IO

import jax

from trainkit import distributed
from trainkit.checkpoint.errors import CheckpointError
from trainkit.core.warn import warn_user

STEP_RECORD = "_CHECKPOINT_METADATA"
#: the lock file a writer holds in a checkpoint directory (:func:`lock_directory`)
LOCK = ".trainkit-lock"
#: what trainkit (and orbax for it) writes in a checkpoint directory, by name: a step, a step set
#: aside as unreadable, orbax's staging of a step, the lock, ``BackupAndRestore``'s goodput journal
#: and its staging (and the old journal set aside while a new one is moved in, left by a process
#: killed in between), a Ray checkpoint being copied in, another process's writability probe
_OWN_NAMES = re.compile(
    r"^(\d+|\d+\.unreadable|\d+\.orbax-checkpoint-tmp.*|\.trainkit-lock|goodput\.json|\.goodput\.json\.writing-.*"
    r"|\.goodput\.json\.old-\d+"
    r"|\.ray-restore-\d+|\.trainkit-probe-.*)$"
)
#: The suffix of a corrupt step directory moved aside, and how long the other processes wait
#: (seconds) for process 0 to move it (a filesystem wait: no collective on a path only some see).
SET_ASIDE, SET_ASIDE_WAIT = ".unreadable", 60.0


def written_by_trainkit(name: str) -> bool:
    """Whether an entry of a checkpoint directory is one trainkit writes there (by its name).

    >>> names = ("12", "12.orbax-checkpoint-tmp", ".trainkit-lock", ".trainkit-probe-x1", "goodput.json", "notes.txt")
    >>> [written_by_trainkit(name) for name in names]
    [True, True, True, True, True, False]
    >>> written_by_trainkit(".goodput.json.old-6636")  # a killed journal write's old copy
    True
    """
    return _OWN_NAMES.match(name) is not None


def foreign_entries(directory: str) -> list[str]:
    """The entries of ``directory`` that trainkit did not write (sorted; none for a missing folder)."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(name for name in names if not written_by_trainkit(name))


def unreadable_steps(directory: str) -> list[str]:
    """The step directories of ``directory`` whose orbax step record is not a JSON object
    (overwritten or truncated files): orbax cannot even open the directory while they are there."""
    found = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
        record = os.path.join(directory, name, STEP_RECORD)
        if not name.isdigit() or not os.path.exists(record):
            continue
        try:
            with open(record) as f:
                readable = isinstance(json.load(f), dict)
        except (OSError, ValueError):
            readable = False
        if not readable:
            found.append(name)
    return found


def set_aside_unreadable_steps(directory: str, read_only: bool) -> None:
    """Renames each unreadable step directory to ``<step>.unreadable`` (kept, not deleted;
    orbax ignores the name) with a warning, so that the other steps open; a reader, which
    changes nothing, raises naming them instead."""
    bad = unreadable_steps(directory)
    if not bad:
        return
    if read_only:
        raise CheckpointError(
            f"The checkpoint step(s) {bad} in {directory!r} are corrupt (their {STEP_RECORD} is not JSON), "
            "and orbax cannot open the directory while they are there. Move or delete them to read the other steps."
        )
    if not distributed.is_main_process():  # process 0 renames; the others open the directory after it
        deadline = time.monotonic() + SET_ASIDE_WAIT
        while any(os.path.exists(os.path.join(directory, name)) for name in bad) and time.monotonic() < deadline:
            time.sleep(0.1)
        return
    for name in bad:
        os.replace(os.path.join(directory, name), os.path.join(directory, name + SET_ASIDE))
        warn_user(
            f"Checkpoint step {name} in {directory!r} is corrupt (its {STEP_RECORD} is not JSON); it was moved "
            f"to {name + SET_ASIDE}, and the other steps are used."
        )


def unreadable_reason(directory: str, step: int) -> str | None:
    """Why ``step`` in ``directory`` cannot be read back (its manifest's or its arrays' JSON
    metadata unreadable), or ``None``."""
    root = os.path.join(directory, str(step))
    for path in (os.path.join(root, "meta", "metadata"), os.path.join(root, "state", "_METADATA")):
        if path.endswith("_METADATA") and not os.path.exists(path):
            continue
        try:
            with open(path) as f:
                json.load(f)
        except (OSError, ValueError) as error:
            return f"{path!r} is unreadable ({type(error).__name__}: {error})."
    return None


def remove_partial_write(directory: str, step: int) -> None:
    """The half-written ``<step>.orbax-checkpoint-tmp...`` folder of a failed write removed
    (process 0; the next writer would remove it too), so a full disk gets its space back."""
    if not distributed.is_main_process():
        return
    prefix = f"{step}.orbax-checkpoint-tmp"
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if name.startswith(prefix):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


#: Characters orbax's path handling reads as a glob pattern (``[1]``, ``**``): a checkpoint under
#: such a path was written in part and never found again.
GLOB_CHARACTERS = "[]*"


def glob_free_alias(directory: str) -> str | None:
    """For a ``directory`` whose path has glob characters (``sweep[lr=0.01]``), a symbolic link
    to it under a temporary directory without them, through which orbax reads and writes the
    real files; ``None`` for an ordinary path."""
    if not any(c in directory for c in GLOB_CHARACTERS):
        return None
    import tempfile

    holder = tempfile.mkdtemp(prefix="trainkit-checkpoint-")
    if any(c in holder for c in GLOB_CHARACTERS):
        raise CheckpointError(
            f"{directory!r} has one of {GLOB_CHARACTERS!r}, which orbax reads as a glob pattern, and the temporary "
            f"directory {holder!r} does too; rename the checkpoint directory."
        )
    alias = os.path.join(holder, "checkpoints")
    os.symlink(directory, alias)
    return alias


def remove_alias(alias: str | None) -> None:
    if alias is not None:
        os.remove(alias)
        os.rmdir(os.path.dirname(alias))


def lock_directory(directory: str) -> IO[str] | None:
    """An exclusive, non-blocking lock on ``directory`` (process 0 only); ``None`` elsewhere."""
    if jax.process_index() != 0:
        return None
    path = os.path.join(directory, LOCK)
    handle = open(path, "a+")  # noqa: SIM115 - held open while the checkpointer is
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another writer"
        handle.close()
        raise CheckpointError(
            f"{directory!r} is being written by {holder}: two writers in one directory corrupt each other's "
            "checkpoints. Give this run its own directory, or close the other writer (trainer.save / a "
            "ModelCheckpoint of another fit) first."
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    return handle


def unlock(handle: IO[str] | None) -> None:
    if handle is not None:
        try:
            fcntl.flock(handle, fcntl.LOCK_UN)
        finally:
            handle.close()
