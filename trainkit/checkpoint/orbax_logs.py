"""What orbax logs (through absl's logger) that trainkit says better itself: a write that failed
in one of orbax's threads is logged there with its whole traceback, once per thread (a full
disk printed 119 to 215 lines after the one ``CheckpointError`` that names the failure), and
asyncio logs the writes still in flight when orbax's event loop gave up on the first failure
(``Task exception was never retrieved``, a traceback through orbax's serialization). Those
records become debug records (``logging.DEBUG``), shown only where trainkit's logger is at DEBUG;
orbax's notice that a directory opened to read is read only is dropped while trainkit reads.

>>> import logging
>>> where, failure = "/x/orbax/checkpoint/future.py", (OSError, OSError("disk full"), None)
>>> record = logging.LogRecord("absl", logging.ERROR, where, 1, "raised", (), failure)
>>> ThreadTracebacksToDebug().filter(record), record.levelname
(False, 'DEBUG')
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from collections.abc import Iterator

_ABSL, _ASYNCIO, _TRAINKIT = logging.getLogger("absl"), logging.getLogger("asyncio"), logging.getLogger("trainkit")
_ORBAX = f"{os.sep}orbax{os.sep}"


def _through_orbax(record: logging.LogRecord) -> bool:
    """Whether ``record`` carries a traceback that orbax logged or that passes through orbax's code."""
    if not record.exc_info:
        return False
    if _ORBAX in record.pathname:
        return True
    frames = traceback.extract_tb(record.exc_info[2]) if record.exc_info[2] is not None else []
    return any(_ORBAX in frame.filename for frame in frames)


class ThreadTracebacksToDebug(logging.Filter):
    """Moves a record with a traceback from orbax's threads or event loop to DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG and _through_orbax(record):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return _TRAINKIT.isEnabledFor(logging.DEBUG)  # shown where trainkit's debug logging is on
        return True


def install() -> None:
    """Adds :class:`ThreadTracebacksToDebug` to absl's logger (orbax's threads) and asyncio's
    (orbax's event loop), once per process."""
    for logger in (_ABSL, _ASYNCIO):
        if not any(isinstance(f, ThreadTracebacksToDebug) for f in logger.filters):
            logger.addFilter(ThreadTracebacksToDebug())


class _ReadOnlyNotice(logging.Filter):
    """Drops orbax's ``Given directory is read only`` warning (a read is what was asked for)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Given directory is read only")


@contextlib.contextmanager
def without_read_only_notice() -> Iterator[None]:
    """absl's logger (orbax logs through it) without the read-only notice while it lasts."""
    notice = _ReadOnlyNotice()
    _ABSL.addFilter(notice)
    try:
        yield
    finally:
        _ABSL.removeFilter(notice)
