"""Files that survive a failed write: everything is written under a temporary name beside its
target and renamed into place once complete, so a full disk, a file-size limit or a ``kill -9``
leaves the previous file whole (or no file), never a truncated one.

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "notes.txt")
>>> write_text(path, "first")
>>> try:
...     with staged(path) as temporary:
...         _ = open(temporary, "w").write("half")
...         raise OSError("disk full")
... except OSError:
...     pass
>>> open(path).read(), sorted(os.listdir(os.path.dirname(path)))
('first', ['notes.txt'])
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Collection, Iterator, Sequence

from trainkit.distributed import filesystem

#: Files a writer may put beside its output under the output's name plus a suffix (ONNX keeps
#: initializers past 2 GB in ``<model>.onnx.data``): moved with it, or removed when stale.
SIDECARS = (".data",)


#: a staging folder's name: the target's, this process's id and host, mkdtemp's random part
_STAGING = re.compile(r"^\.(?P<name>.+)\.writing-(?:(?P<pid>\d+)@(?P<host>[^/]*)-)?[A-Za-z0-9_]{8}$")
#: a staging folder of an older trainkit (no process named) is stale after this many seconds
UNNAMED_STALE_SECONDS = 3600.0


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False


def remove_stale_staging(target: str) -> list[str]:
    """Removes the staging folders beside ``target`` that a killed write left (``kill -9``,
    a lost machine): those of a process of this host that no longer runs, and unnamed ones
    older than an hour. Returns their names.

    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> os.mkdir(os.path.join(folder, ".model.jax.writing-999999999@" + _host() + "-abcd1234"))
    >>> remove_stale_staging(os.path.join(folder, "model.jax")), os.listdir(folder)
    (['.model.jax.writing-999999999@...-abcd1234'], [])
    """
    parent, base = os.path.split(target)
    removed = []
    for name in os.listdir(parent) if os.path.isdir(parent) else []:
        found = _STAGING.match(name)
        if not found or found["name"] != base:
            continue
        path = os.path.join(parent, name)
        if found["pid"] is not None:
            stale = found["host"] == _host() and _dead(int(found["pid"]))
        else:
            stale = time.time() - os.path.getmtime(path) > UNNAMED_STALE_SECONDS
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed


def holds_working_directory(path: str) -> bool:
    """Whether ``path`` is the working directory or a folder above it (never replaced or removed)."""
    target, here = os.path.realpath(path), os.path.realpath(os.getcwd())
    return here == target or here.startswith(target.rstrip(os.sep) + os.sep)


def check_replaceable(target: str, folder_entries: Collection[str] = ()) -> None:
    """Refuses, before anything is written, to write ``target`` where that would delete what
    trainkit did not write: the working directory or a folder above it, or an existing folder
    holding anything but ``folder_entries`` (the names the output itself has: a folder trainkit
    wrote before, replaced whole). An empty folder may be replaced.

    >>> import tempfile
    >>> folder = tempfile.mkdtemp(); _ = open(os.path.join(folder, "notes.txt"), "w").close()
    >>> check_replaceable(folder, {"saved_model.pb", "variables"})
    Traceback (most recent call last):
    FileExistsError: ... holds files this output does not have (notes.txt): ...
    """
    target = os.path.realpath(target)
    if holds_working_directory(target):
        raise FileExistsError(
            f"{target!r} is the working directory (or holds it): writing there would replace everything in it. Name "
            "a new file or folder inside it, e.g. 'model' or 'exports/model'."
        )
    above = os.path.dirname(target)
    while above != os.path.dirname(above) and not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise NotADirectoryError(
            f"{target!r} lies under {above!r}, which is a file, not a folder: nothing was written. Name a path whose "
            "folders are folders (or move that file)."
        )
    if not os.path.isdir(target):
        return
    foreign = sorted(name for name in os.listdir(target) if name not in folder_entries)
    if foreign:
        shown = ", ".join(foreign[:8]) + (f", ... ({len(foreign)} in all)" if len(foreign) > 8 else "")
        raise FileExistsError(
            f"{target!r} is a folder that holds files this output does not have ({shown}): writing it would delete "
            "them. Nothing was written; name a new path, or move those files first."
        )


@contextlib.contextmanager
def staged(
    path: str | os.PathLike[str],
    sidecars: Sequence[str] = SIDECARS,
    folder_entries: Collection[str] = (),
    *,
    folder: str | None = None,
) -> Iterator[str]:
    """A temporary path (in a new folder beside ``path``) to write ``path``'s file or folder
    to; moved into place when the block ends without an error, else removed with everything
    written there. Sidecars written beside it (``<name><suffix>``) are moved first; an old
    sidecar the new output does not have is removed, so nothing stale is read with it. Staging
    folders that killed writes to the same target left are removed first. An existing folder at
    ``path`` is replaced only when it holds nothing but ``folder_entries`` (:func:`check_replaceable`,
    before anything is written). ``folder``: the output is a folder, named so in the refusal of an
    existing file at ``path`` (:func:`~trainkit.distributed.filesystem.require_folder`)."""
    target = os.path.abspath(os.fspath(path))
    if folder is not None:
        filesystem.require_folder(target, folder)
    check_replaceable(target, folder_entries)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    remove_stale_staging(target)
    try:
        staging = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(target)}.writing-{os.getpid()}@{_host()}-")
    except OSError as error:
        raise _naming(error, target, error.filename or "", "its folder cannot be written") from error
    try:
        temporary = os.path.join(staging, os.path.basename(target))
        try:
            yield temporary
        except OSError as error:  # the writer's error names the hidden staging file, or no file: name the target
            raise _naming(error, target, temporary, "nothing was replaced") from error
        moves = [(temporary, target)]
        moves += [(temporary + suffix, target + suffix) for suffix in sidecars if os.path.exists(temporary + suffix)]
        stale = [target + s for s in sidecars if not os.path.exists(temporary + s) and os.path.isfile(target + s)]
        _commit(moves, stale)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _naming(error: OSError, target: str, hidden: str, what: str) -> OSError:
    """``error`` (raised writing a staged file) as the same kind of error naming ``target``, not the
    hidden staging path ``hidden`` it was written at."""
    reason = error.strerror or str(error).replace(hidden, "") or type(error).__name__  # no hidden path
    try:
        named = type(error)(error.errno or 0, f"{reason} (writing {target}; {what})", target)
    except TypeError:  # an OSError subclass of another signature
        named = OSError(error.errno or 0, f"{reason} (writing {target}; {what})", target)
    return named


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def _commit(moves: Sequence[tuple[str, str]], removals: Sequence[str] = ()) -> None:
    """Each ``(source, target)`` moved into place and ``removals`` removed, as one step: what
    is there is renamed aside first, and when a move fails, what was placed is taken out and the
    old files are put back; so either the old set (a model and its sidecar) or the new one is
    whole, never a new model with an old sidecar."""
    aside: list[tuple[str, str]] = []
    placed: list[str] = []
    try:
        for path in [target for _, target in moves] + list(removals):
            if os.path.lexists(path):
                hidden = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.old-{os.getpid()}")
                _remove(hidden)  # a leftover of a killed commit
                os.replace(path, hidden)
                aside.append((path, hidden))
        for source, target in moves:
            os.replace(source, target)
            placed.append(target)
    except BaseException:
        for target in placed:
            _remove(target)
        for path, hidden in reversed(aside):
            os.replace(hidden, path)
        raise
    for _, hidden in aside:
        _remove(hidden)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """``data`` as the whole content of ``path``, flushed to disk before it replaces the old file."""
    with staged(path, sidecars=()) as temporary, open(temporary, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """``text`` (UTF-8) as the whole content of ``path``, as :func:`write_bytes`."""
    write_bytes(path, text.encode())
