"""What orbax logs (through absl's logger) that trainkit says better itself: a write that failed
in one of orbax's threads is logged there with its whole traceback, once per thread (a full
disk printed 119 to 215 lines after the one ``CheckpointError`` that names the failure), and
asyncio logs the writes still in flight when orbax's event loop gave up on the first failure
(``Task exception was never retrieved``, a traceback through orbax's serialization). Those
records become debug records (``logging.DEBUG``), shown only where trainkit's logger is at DEBUG;
orbax's notice that a directory opened to read is read only is dropped while trainkit reads.
The writes still in flight in tensorstore's threads when that loop closed report to the closed
loop as they finish (often as the interpreter exits), each a ``RuntimeError: Event loop is
closed`` that tensorstore hands to ``sys.unraisablehook``: a chained hook makes those debug
records too, and passes every other unraisable exception on.

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
import sys
import traceback
from collections.abc import Callable, Iterator

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


def _completion_after_close(unraisable: sys.UnraisableHookArgs) -> bool:
    """Whether an unraisable exception is a completion reported to a closed asyncio event loop
    (``call_soon_threadsafe`` raising ``RuntimeError('Event loop is closed')``)."""
    error = unraisable.exc_value
    if not isinstance(error, RuntimeError) or str(error) != "Event loop is closed":
        return False
    frames = traceback.extract_tb(unraisable.exc_traceback) if unraisable.exc_traceback is not None else []
    return bool(frames) and frames[-1].name == "_check_closed" and any(f.name == "call_soon_threadsafe" for f in frames)


class LateCompletionsToDebug:
    """A ``sys.unraisablehook`` that makes a completion reported to a closed event loop a debug
    record of trainkit's logger and hands every other unraisable exception to ``previous``."""

    def __init__(self, previous: Callable[[sys.UnraisableHookArgs], object]):
        self.previous = previous

    def __call__(self, unraisable: sys.UnraisableHookArgs) -> None:
        if not _completion_after_close(unraisable):
            self.previous(unraisable)
            return
        with contextlib.suppress(Exception):  # at interpreter exit, logging may be gone
            _TRAINKIT.debug(
                "a write finished after orbax's event loop closed on a failed write", exc_info=unraisable.exc_value
            )


def install() -> None:
    """Adds :class:`ThreadTracebacksToDebug` to absl's logger (orbax's threads) and asyncio's
    (orbax's event loop), and :class:`LateCompletionsToDebug` before ``sys.unraisablehook``,
    once per process."""
    for logger in (_ABSL, _ASYNCIO):
        if not any(isinstance(f, ThreadTracebacksToDebug) for f in logger.filters):
            logger.addFilter(ThreadTracebacksToDebug())
    if not isinstance(sys.unraisablehook, LateCompletionsToDebug):
        sys.unraisablehook = LateCompletionsToDebug(sys.unraisablehook)


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
