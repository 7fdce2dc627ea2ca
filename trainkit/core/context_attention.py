"""``tk.attention``: dot-product attention that a context axis splits by hand.

Outside a context step it is ``jax.nn.dot_product_attention``. While a step of a strategy with a
context axis (``Hybrid(data=2, context=4)``) is traced, each device keeps its chunk of the
queries, all-gathers the keys and values over the axis (MaxText's default ``all_gather`` way),
and masks by the chunk's global positions; the outputs stay split like the queries. Without it
the compiler gathers what attention needs from the layout alone; with it, what is gathered is
stated, not found.

>>> import jax.numpy as jnp
>>> q = k = v = jnp.ones((1, 4, 2, 8))  # (batch, length, heads, head_dim)
>>> attention(q, k, v, causal=True).shape
(1, 4, 2, 8)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from trainkit.core.scoped import scoped


@dataclasses.dataclass(frozen=True)
class ContextSplit:
    """The mesh and axis a step splits each sequence over, and the axes its rows are split over."""

    mesh: Mesh
    axis: str
    batch_axes: tuple[str, ...] = ()


_ACTIVE: contextvars.ContextVar[ContextSplit | None] = contextvars.ContextVar("context_split", default=None)


def context_split(split: ContextSplit) -> contextlib.AbstractContextManager[None]:
    """While a step is traced: :func:`attention` splits over ``split``'s axis."""
    return scoped(_ACTIVE, split)


def attention(
    query: jax.Array, key: jax.Array, value: jax.Array, *, causal: bool = False, scale: float | None = None
) -> jax.Array:
    """Softmax attention of ``(batch, length, heads, head_dim)`` arrays, causal or not, split
    over a context axis inside a context step (see the module)."""
    split = _ACTIVE.get()
    size = 1 if split is None else int(split.mesh.shape[split.axis])
    if split is None or size == 1 or query.shape[1] % size or key.shape[1] % size:
        return jax.nn.dot_product_attention(query, key, value, scale=scale, is_causal=causal)
    axis, rows = split.axis, split.batch_axes
    if query.shape[0] % max(1, int(math.prod(split.mesh.shape[a] for a in rows))):
        rows = ()  # rows the data axes do not divide (a micro-batch): whole on each device
    spec = PartitionSpec(rows or None, axis)

    def local(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        keys = jax.lax.all_gather(k, axis, axis=1, tiled=True)
        values = jax.lax.all_gather(v, axis, axis=1, tiled=True)
        if not causal:
            return jax.nn.dot_product_attention(q, keys, values, scale=scale)
        start = jax.lax.axis_index(axis) * q.shape[1]  # this chunk's first global position
        positions = start + jnp.arange(q.shape[1])[:, None]
        mask = positions >= jnp.arange(keys.shape[1])[None, :]
        return jax.nn.dot_product_attention(q, keys, values, scale=scale, mask=mask[None, None])

    run = functools.partial(
        jax.shard_map,
        mesh=split.mesh,
        in_specs=(spec, spec, spec),
        out_specs=spec,
        axis_names={axis, *rows},
        check_vma=False,
    )
    out: jax.Array = run(local)(query, key, value)
    return out
