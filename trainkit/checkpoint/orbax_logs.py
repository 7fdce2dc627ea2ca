"""What orbax logs (through absl's logger) that trainkit says better itself: a write that failed
in one of orbax's threads is logged there with its whole traceback, once per thread (a full
disk printed 119 to 215 lines after the one ``CheckpointError`` that names the failure). Those
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
from collections.abc import Iterator

_ABSL, _TRAINKIT = logging.getLogger("absl"), logging.getLogger("trainkit")


class ThreadTracebacksToDebug(logging.Filter):
    """Moves an orbax record with a traceback (an error in one of its threads) to DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and f"{os.sep}orbax{os.sep}" in record.pathname and record.levelno > logging.DEBUG:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return _TRAINKIT.isEnabledFor(logging.DEBUG)  # shown where trainkit's debug logging is on
        return True


def install() -> None:
    """Adds :class:`ThreadTracebacksToDebug` to absl's logger, once per process."""
    if not any(isinstance(f, ThreadTracebacksToDebug) for f in _ABSL.filters):
        _ABSL.addFilter(ThreadTracebacksToDebug())


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
