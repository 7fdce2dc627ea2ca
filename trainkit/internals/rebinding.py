"""A module attribute or a frozen module's field swapped for the length of a ``with`` block and
always put back (an exception inside included): with :mod:`~trainkit.internals.qwix`'s, the only
places trainkit sets attributes on objects it does not own.

>>> import types
>>> place = types.SimpleNamespace(value=1)
>>> with rebound([(place, "value", 2)]):
...     place.value
2
>>> place.value
1
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence


@contextlib.contextmanager
def rebound(bindings: Sequence[tuple[object, str, object]]) -> Iterator[None]:
    """Each ``(owner, name, value)``: ``owner.name`` is ``value`` while the block runs, then what it was
    (a module's function routed while a step is traced). The caller serialises overlapping uses."""
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in bindings]
    try:
        for owner, name, value in bindings:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


@contextlib.contextmanager
def field_set(module: object, name: str, value: object) -> Iterator[None]:
    """A frozen dataclass's field (a linen module's: ``attention_fn``, ``use_running_average``) is
    ``value`` for one call of the module, then what it was."""
    before = getattr(module, name)
    object.__setattr__(module, name, value)  # a linen module is a frozen dataclass
    try:
        yield
    finally:
        object.__setattr__(module, name, before)
