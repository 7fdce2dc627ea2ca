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


def write_problem(directory: str | os.PathLike[str], probe_bytes: int = 0) -> str | None:
    """Why ``directory`` cannot be created or a file written in it (``"PermissionError:
    Permission denied"``), or ``None``. With ``probe_bytes``, that many bytes are written and
    synced, so a full disk shows too."""
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
