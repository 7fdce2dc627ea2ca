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
import shutil
import tempfile
from collections.abc import Iterator, Sequence

#: Files a writer may put beside its output under the output's name plus a suffix (ONNX keeps
#: initializers past 2 GB in ``<model>.onnx.data``): moved with it, or removed when stale.
SIDECARS = (".data",)


@contextlib.contextmanager
def staged(path: str | os.PathLike, sidecars: Sequence[str] = SIDECARS) -> Iterator[str]:
    """A temporary path (in a new folder beside ``path``) to write ``path``'s file or folder
    to; moved into place when the block ends without an error, else removed with everything
    written there. Sidecars written beside it (``<name><suffix>``) are moved first; an old
    sidecar the new output does not have is removed, so nothing stale is read with it."""
    target = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(target)}.writing-")
    try:
        temporary = os.path.join(staging, os.path.basename(target))
        yield temporary
        for suffix in sidecars:
            if os.path.exists(temporary + suffix):
                os.replace(temporary + suffix, target + suffix)
            elif os.path.isfile(target + suffix):
                os.remove(target + suffix)
        _replace(temporary, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _replace(source: str, target: str) -> None:
    """``os.replace``, also for a folder over an existing one: the old one is renamed aside,
    the new one renamed into place, then the old one deleted."""
    if not os.path.isdir(source) or not os.path.exists(target):
        os.replace(source, target)
        return
    aside = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=f".{os.path.basename(target)}.old-")
    os.rmdir(aside)
    os.replace(target, aside)
    os.replace(source, target)
    shutil.rmtree(aside, ignore_errors=True)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """``data`` as the whole content of ``path``, flushed to disk before it replaces the old file."""
    with staged(path, sidecars=()) as temporary, open(temporary, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def write_text(path: str | os.PathLike, text: str) -> None:
    """``text`` (UTF-8) as the whole content of ``path``, as :func:`write_bytes`."""
    write_bytes(path, text.encode())
