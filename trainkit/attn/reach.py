"""Reaching the attention a model already calls, so a context axis splits it by hand without
the model being edited.

While a step with a context axis is traced (:func:`reaching_attention`), three doors lead to
:func:`~trainkit.attn.context_axis.split_attention`:

- ``nn.MultiHeadDotProductAttention`` (and ``nn.SelfAttention``) with Flax's default
  ``attention_fn``: a Flax method interceptor (as the frozen-statistics feature uses) gives the
  call the routed function for its length;
- ``nn.dot_product_attention`` and ``jax.nn.dot_product_attention`` called by name (``nn.`` /
  ``jax.nn.`` looked up at the call): those module attributes are routed for the trace's length
  and put back after. The routed function reads the step's context variable, so anything else
  traced meanwhile (another thread, no context axis) gets the original.

A name bound before (``from jax.nn import dot_product_attention``), a custom ``attention_fn`` or
attention written out by hand is not reached: the compiler gathers what it needs from the layout,
and the plan's notes say no attention was split.

>>> import jax, jax.numpy as jnp
>>> from jax.sharding import Mesh
>>> from trainkit.attn import ContextSplit, attention_calls
>>> mesh = Mesh(jax.devices()[:4], ("context",))
>>> q = jnp.ones((1, 8, 2, 4))
>>> with attention_calls() as calls, reaching_attention(ContextSplit(mesh, "context")):
...     out = jax.jit(lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True))(q)
>>> [(call.door, call.split) for call in calls]
[('jax.nn.dot_product_attention', True)]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable, Iterator

import flax.linen as nn
import flax.linen.attention as linen_attention
import jax

from trainkit.attn.context_axis import ContextSplit, active_split, split_attention
from trainkit.core.trace_context import Scoped, under
from trainkit.core.tree import PyTree
from trainkit.internals.rebinding import field_set, rebound

_FLAX_ATTENTION = linen_attention.dot_product_attention
_JAX_ATTENTION = jax.nn.dot_product_attention


def _routed(original: Callable[..., jax.Array], door: str) -> Callable[..., jax.Array]:
    """``original`` split over the active context axis, itself outside one."""
    signature = inspect.signature(original)

    @functools.wraps(original)  # its signature too: MultiHeadDotProductAttention filters its arguments by it
    def routed(*args: object, **kwargs: object) -> jax.Array:
        if active_split() is None:
            return original(*args, **kwargs)
        options = dict(signature.bind(*args, **kwargs).arguments)
        query, key, value = (options.pop(name) for name in ("query", "key", "value"))
        return split_attention(original, door, query, key, value, options)

    return routed


_MULTI_HEAD = _routed(_FLAX_ATTENTION, "nn.MultiHeadDotProductAttention")
_BY_NAME = (  # (module, attribute, original, routed)
    (jax.nn, "dot_product_attention", _JAX_ATTENTION, _routed(_JAX_ATTENTION, "jax.nn.dot_product_attention")),
    (nn, "dot_product_attention", _FLAX_ATTENTION, _routed(_FLAX_ATTENTION, "nn.dot_product_attention")),
    (linen_attention, "dot_product_attention", _FLAX_ATTENTION, _routed(_FLAX_ATTENTION, "nn.dot_product_attention")),
)


class _Routing:
    """The module attributes routed while at least one trace needs them (counted: traces nest and
    threads overlap), and put back when the last one ends."""

    def __init__(self) -> None:
        self._lock, self._users = threading.Lock(), 0
        self._bound: contextlib.ExitStack | None = None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self._bound = contextlib.ExitStack()
                self._bound.enter_context(rebound([(module, name, routed) for module, name, _, routed in _BY_NAME]))
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0 and self._bound is not None:
                    self._bound.close()  # every original back
                    self._bound = None


_ROUTING = _Routing()


def _intercept_multi_head(
    next_fun: Callable[..., PyTree],
    args: tuple[PyTree, ...],
    kwargs: dict[str, PyTree],
    context: nn.module.InterceptorContext,
) -> PyTree:
    """A Flax method interceptor: ``MultiHeadDotProductAttention.__call__`` with Flax's own
    attention runs with the routed one (the module's field swapped for the call, then restored)."""
    module = context.module
    if not (
        context.method_name == "__call__"
        and isinstance(module, nn.MultiHeadDotProductAttention)
        and module.attention_fn is _FLAX_ATTENTION
    ):
        return next_fun(*args, **kwargs)
    with field_set(module, "attention_fn", _MULTI_HEAD):  # a frozen dataclass field, for this call
        return next_fun(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class ReachAttention(Scoped):
    """The trace context's part that routes the doors above to the context split while a step is
    traced (``Hybrid(..., reach_attention=True)``)."""

    def entered(self) -> contextlib.AbstractContextManager[object]:
        stack = contextlib.ExitStack()
        stack.enter_context(_ROUTING.active())
        stack.enter_context(nn.intercept_methods(_intercept_multi_head))
        return stack


def reaching_attention(split: ContextSplit) -> contextlib.AbstractContextManager[None]:
    """While a step with a context axis is traced: ``tk.attention`` and the doors above split over
    ``split``'s axis (the two parts a strategy's compile hands its steps)."""
    return under(split, ReachAttention())
