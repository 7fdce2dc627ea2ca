"""A context variable set for the length of a ``with`` block: what trainkit's trace-time settings
(a custom step's helpers, a pipeline's schedule, a context split) are.

>>> import contextvars
>>> mode = contextvars.ContextVar("mode", default="off")
>>> with scoped(mode, "on"):
...     mode.get()
'on'
>>> mode.get()
'off'
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def scoped(variable: contextvars.ContextVar[T], value: T) -> Iterator[None]:
    """``variable`` set to ``value`` while the block runs, restored however it ends."""
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)
