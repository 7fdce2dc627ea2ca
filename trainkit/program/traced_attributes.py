"""Nothing leaks through ``self`` from a step of the user's own: the trainer's attributes around
each trace of its ``train_step`` / ``test_step``.

- an attribute the step sets while it is traced (``self.last_d_loss = d_loss``, an EMA target
  kept on ``self``) would keep a leaked tracer: the trainer's attributes are put back as they
  were and the trace is refused, naming the fix (return it in the logs, keep it in the state);
- a plain value the step may read from ``self`` (``self.beta``: a number of any kind, a NumPy
  scalar or a 0-d array included, a string, a tuple of them) is a constant of the compiled step:
  when one has changed before the next run, :meth:`TracedAttributes.changed` names it and the
  steps are traced again.

>>> class Owner: beta = None
>>> owner = Owner(); owner.beta = 0.1
>>> attributes = TracedAttributes(owner)
>>> with attributes.tracing("train_step"):
...     pass
>>> owner.beta = 0.0
>>> attributes.changed()
['beta: 0.1 -> 0.0']
>>> with attributes.tracing("train_step"):
...     owner.leaked = 1
Traceback (most recent call last):
trainkit.core.checks.SettingError: train_step set self.leaked while trainkit traced it: ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator

import jax
import numpy as np

from trainkit.core.checks import SettingError

_PLAIN = (bool, int, float, complex, str, bytes, type(None), np.generic)


def _plain(value: object) -> bool:
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN) or _scalar_array(value)


def _scalar_array(value: object) -> bool:
    """A 0-d NumPy or JAX array (``np.array(0.5)``, ``jnp.float32(0.5)``): a number the step reads."""
    return isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0


def _as_read(value: object) -> object:
    """``value`` as the step read it: a number of a 0-d array (which may be written in place) or a tuple of them."""
    if isinstance(value, tuple):
        return tuple(_as_read(v) for v in value)
    return np.asarray(value).item() if _scalar_array(value) or isinstance(value, np.generic) else value


def _plain_attributes(owner: object) -> dict[str, object]:
    """The plain values ``owner.name`` reads: its own, and its classes' outside trainkit (a
    subclass's ``beta = 0.1``)."""
    found: dict[str, object] = {}
    for cls in reversed(type(owner).__mro__):
        if not cls.__module__.startswith("trainkit"):
            found.update({k: _as_read(v) for k, v in vars(cls).items() if not k.startswith("__") and _plain(v)})
    found.update({k: _as_read(v) for k, v in vars(owner).items() if _plain(v)})
    return found


class TracedAttributes:
    """The plain attributes of ``owner`` (the trainer; ``None``: nothing watched) the steps were
    traced with, and the refusal of an attribute set while one is traced."""

    def __init__(self, owner: object | None) -> None:
        self.owner = owner
        self.values: dict[str, object] = {}

    @contextlib.contextmanager
    def tracing(self, step: str) -> Iterator[None]:
        """Around one trace of ``step``: refuses (and undoes) an attribute it set, and notes the
        plain values it may have read."""
        if self.owner is None:
            yield
            return
        attributes = vars(self.owner)
        before = dict(attributes)
        yield
        set_ = [k for k, v in attributes.items() if k not in before or v is not before[k]]
        if set_:
            attributes.clear()
            attributes.update(before)  # the trainer as it was: no tracer kept
            raise SettingError(
                f"{step} set self.{set_[0]} while trainkit traced it: the step runs compiled, so the attribute would "
                "hold a tracer of that one trace (reading it later fails), never a value of a step. Return the value "
                "in the logs (return state, {'d_loss': d_loss}) and read it from a callback's logs or History, or "
                "keep state that must carry over (an EMA target, a queue) in the state (docs/custom_training.md, "
                "'State of your own')."
            )
        self.values.update(_plain_attributes(self.owner))

    def changed(self, names: Collection[str] | None = None, forget: bool = True) -> list[str]:
        """``'name: old -> new'`` for each plain value (of ``names``, default all) that changed since
        the steps were traced; ``forget``: then forgotten (the next trace notes them again)."""
        if self.owner is None or not self.values:
            return []
        now = _plain_attributes(self.owner)
        changed = [
            f"{k}: {v!r} -> {now.get(k)!r}"
            for k, v in self.values.items()
            if (names is None or k in names) and (k not in now or now[k] != v)
        ]
        if changed and forget:
            self.values = {}
        return changed
