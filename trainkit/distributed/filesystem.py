"""Whether a directory can be written, asked once before anything depends on it (checkpoints,
the compilation cache, log directories, which every process of a run may share), so that a run
fails or falls back at its start, not in the middle. Here, at the bottom of the imports, so that
the compilation cache (in this package) and the packages above share one probe.

>>> import tempfile
>>> write_problem(tempfile.mkdtemp()) is None
True
>>> write_problem("/proc/no-such-place").split(":")[0]
'FileNotFoundError'
"""

from __future__ import annotations

import os
import tempfile


def file_in_place(folder: str | os.PathLike[str]) -> str | None:
    """Why a folder cannot be written at ``folder`` without deleting a file: an existing file (or a
    link to one) is there; ``None`` when nothing or a folder is. Every writer of a folder
    (checkpoints, backups, exports, ``save_pretrained``, log directories) asks it first.

    >>> import tempfile
    >>> file_in_place(tempfile.mkstemp()[1]).startswith("it is an existing file")
    True
    """
    if os.path.lexists(folder) and not os.path.isdir(folder):
        return "it is an existing file, not a folder: writing a folder there would replace it (nothing was changed)"
    return None


def require_folder(folder: str | os.PathLike[str], what: str) -> None:
    """Raises a ``FileExistsError`` naming ``what`` when :func:`file_in_place` finds a file at ``folder``."""
    problem = file_in_place(folder)
    if problem is not None:
        raise FileExistsError(f"{what} {os.fspath(folder)!r}: {problem}. Name a new path, or move that file.")


def write_problem(directory: str | os.PathLike[str], probe_bytes: int = 0) -> str | None:
    """Why ``directory`` cannot be created or a file written in it (``"PermissionError:
    Permission denied"``, an existing file there), or ``None``. With ``probe_bytes``, that many
    bytes are written and synced, so a full disk shows too."""
    in_place = file_in_place(directory)
    if in_place is not None:
        return in_place
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=os.fspath(directory), prefix=".trainkit-probe-") as probe:
            if probe_bytes:
                probe.write(b"0" * probe_bytes)
                probe.flush()
                os.fsync(probe.fileno())
    except OSError as error:
        return f"{type(error).__name__}: {error.strerror or error}"
    return None
