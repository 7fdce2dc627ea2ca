"""What a step is traced under, as one value in one context variable (#82): the parts a
strategy's compile hands down once (the platform attention is chosen for, the context split, a
pipeline's schedule) and those trainkit's own step sets while it traces (the frozen BatchNorm
layers, the loss call being traced, the attention calls being collected). Each part is a value
of its own type, found by that type: a module reads only the part it owns.

>>> import dataclasses
>>> @dataclasses.dataclass(frozen=True)
... class Mode:
...     name: str
>>> with under(Mode("on")):
...     current(Mode), traced_under(lambda: current(Mode), Mode("inner"))()
(Mode(name='on'), Mode(name='inner'))
>>> current(Mode) is None
True
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")

#: the parts of the trace under way, at most one of each type
_CONTEXT: contextvars.ContextVar[tuple[object, ...]] = contextvars.ContextVar("trace_context", default=())


class Scoped(abc.ABC):
    """A part that also puts a library's own context in place while it is in effect (Flax's
    logical axis rules, its method interceptors): :func:`under` enters :meth:`entered` after
    setting the part."""

    @abc.abstractmethod
    def entered(self) -> contextlib.AbstractContextManager[object]:
        """The library's context this part stands for."""


def current(kind: type[T]) -> T | None:
    """The part of type ``kind`` the trace under way holds (``None``: none)."""
    return next((part for part in _CONTEXT.get() if isinstance(part, kind)), None)


@contextlib.contextmanager
def under(*parts: object, without: tuple[type, ...] = ()) -> Iterator[None]:
    """The block traced with ``parts`` (each replacing the part of its type) and none of the types
    ``without``; the context as it was however the block ends."""
    replaced = (*(type(part) for part in parts), *without)
    kept = tuple(part for part in _CONTEXT.get() if not isinstance(part, replaced))
    token = _CONTEXT.set((*kept, *parts))
    try:
        with contextlib.ExitStack() as stack:
            for part in parts:
                if isinstance(part, Scoped):
                    stack.enter_context(part.entered())
            yield
    finally:
        _CONTEXT.reset(token)


def traced_under(fn: Callable[P, R], *parts: object | None) -> Callable[P, R]:
    """``fn`` (a step), each trace of it under ``parts`` (``None`` ones left out; none: ``fn``
    itself): the one wrapper through which a strategy's compile hands a step its context."""
    given = tuple(part for part in parts if part is not None)
    if not given:
        return fn

    @functools.wraps(fn)
    def traced(*args: P.args, **kwargs: P.kwargs) -> R:
        with under(*given):
            return fn(*args, **kwargs)

    return traced
