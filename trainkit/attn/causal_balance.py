"""Causal attention over a context axis with the work balanced: each device computes only the
score tiles its queries can see, the same number on every device.

Split contiguously over ``C`` devices, device ``d``'s queries see ``d + 1`` of the ``C`` key
chunks: the last device computes ``C`` times the first one's share, and a step waits for the
slowest. Halve each chunk (``2C`` half-chunks) and give device ``d`` half-chunks ``d`` (early)
and ``2C-1-d`` (late), as MaxText's and torchtitan's load balancers do: it then needs ``d + 1``
and ``2C - d`` key tiles, ``2C + 1`` on every device, against the ``4C`` tiles of the whole
``T/C x T`` block the plain all-gather way computes. Here the activations keep their contiguous
layout; only the queries move, two ``ppermute``s there and two back, each a half-chunk per device
(the keys and values are all-gathered anyway). The tiles run as one online softmax (``2C + 1``
steps of the same shapes on every device, unrolled), in float32.

Inside a ``shard_map`` that is manual over ``axis``:

>>> import jax, jax.numpy as jnp, numpy as np
>>> from jax.sharding import Mesh, PartitionSpec as P
>>> mesh = Mesh(jax.devices()[:4], ("context",))
>>> q = jnp.asarray(np.random.default_rng(0).normal(size=(1, 16, 2, 8)), jnp.float32)
>>> def local(q, k, v):
...     k, v = (jax.lax.all_gather(a, "context", axis=1, tiled=True) for a in (k, v))
...     return balanced_causal_attention(q, k, v, axis="context", size=4)
>>> split = jax.shard_map(local, mesh=mesh, in_specs=P(None, "context"), out_specs=P(None, "context"))
>>> out = jax.jit(split)(q, q, q)
>>> bool(jnp.allclose(out, jax.nn.dot_product_attention(q, q, q, is_causal=True), atol=1e-6))
True
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def tiles_per_device(size: int) -> tuple[int, int]:
    """Score tiles (of ``T/2C x T/2C``) each device computes balanced, and in the whole block.

    >>> tiles_per_device(4)
    (9, 16)
    """
    return 2 * size + 1, 4 * size


def _owner(half: int, size: int) -> int:
    return half if half < size else 2 * size - 1 - half


def balanced_causal_attention(
    query: jax.Array, keys: jax.Array, values: jax.Array, *, axis: str, size: int, scale: float | None = None
) -> jax.Array:
    """Causal softmax attention of this device's contiguous query chunk ``(..., T/C, heads, dim)``
    against the whole keys and values ``(..., T, kv_heads, dim)``, balanced over ``axis`` (``size``
    devices; see the module). ``T/C`` must be even."""
    half = query.shape[-3] // 2
    here = jax.lax.axis_index(axis)
    chunks = jnp.stack(balanced_halves(query, axis=axis, size=size))  # (2, ..., half, heads, dim)
    heads = query.shape[-2]
    keys, values = (jnp.repeat(a, heads // a.shape[-2], axis=-2) for a in (keys, values))  # grouped queries
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    shape = (2, *query.shape[:-3], heads, half)
    top = jnp.full(shape, -jnp.inf, jnp.float32)  # the online softmax: running max, sum, and output
    total = jnp.zeros(shape, jnp.float32)
    out = jnp.zeros((2, *query.shape[:-3], half, heads, query.shape[-1]), jnp.float32)
    diagonal = jnp.tril(jnp.ones((half, half), bool))
    for tile in range(2 * size + 1):  # tiles 0..here of the early chunk, then 0..2C-1-here of the late one
        late_tile = tile > here
        slot = late_tile.astype(jnp.int32)
        block = jnp.where(late_tile, tile - here - 1, tile)
        own = jnp.where(late_tile, 2 * size - 1 - here, here)  # the chunk's own (diagonal) block
        q = jax.lax.dynamic_index_in_dim(chunks, slot, keepdims=False)
        k, v = (jax.lax.dynamic_slice_in_dim(a, block * half, half, axis=a.ndim - 3) for a in (keys, values))
        logits = jnp.einsum("...qhd,...khd->...hqk", q, k, preferred_element_type=jnp.float32) * scale
        seen = jnp.where(block == own, diagonal, True)
        logits = jnp.where(seen, logits, jnp.finfo(jnp.float32).min)
        old_top, old_total, old_out = (jax.lax.dynamic_index_in_dim(a, slot, keepdims=False) for a in (top, total, out))
        new_top = jnp.maximum(old_top, logits.max(-1))
        weights = jnp.exp(logits - new_top[..., None])
        shrink = jnp.exp(old_top - new_top)
        new_total = old_total * shrink + weights.sum(-1)
        moved = jnp.einsum("...hqk,...khd->...qhd", weights, v.astype(jnp.float32))
        new_out = old_out * jnp.swapaxes(shrink, -1, -2)[..., None] + moved
        top, total, out = (
            jax.lax.dynamic_update_index_in_dim(a, b, slot, 0)
            for a, b in ((top, new_top), (total, new_total), (out, new_out))
        )
    out = (out / jnp.swapaxes(total, -1, -2)[..., None]).astype(query.dtype)
    return contiguous_halves(out[0], out[1], axis=axis, size=size)


def _moves(size: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Where each device's first and second half-chunks (global ``2d`` and ``2d+1``) go."""
    return [(d, _owner(2 * d, size)) for d in range(size)], [(d, _owner(2 * d + 1, size)) for d in range(size)]


def balanced_halves(chunk: jax.Array, *, axis: str, size: int) -> tuple[jax.Array, jax.Array]:
    """This device's two half-chunks of the balanced layout, ``(early, late)``: global half-chunks
    ``here`` and ``2C-1-here`` of a sequence split contiguously over ``axis`` (``chunk``: this
    device's ``(..., T/C, heads, dim)``), by two ``ppermute`` calls. :func:`contiguous_halves` undoes it."""
    half = chunk.shape[-3] // 2
    to_first, to_second = _moves(size)
    got_first = jax.lax.ppermute(chunk[..., :half, :, :], axis, to_first)
    got_second = jax.lax.ppermute(chunk[..., half:, :, :], axis, to_second)
    even = jax.lax.axis_index(axis) % 2 == 0  # an even device gets its early half-chunk from the first permute
    return jnp.where(even, got_first, got_second), jnp.where(even, got_second, got_first)


def contiguous_halves(early: jax.Array, late: jax.Array, *, axis: str, size: int) -> jax.Array:
    """:func:`balanced_halves` undone: this device's contiguous chunk from the balanced half-chunks."""
    to_first, to_second = _moves(size)
    even = jax.lax.axis_index(axis) % 2 == 0
    back_first, back_second = jnp.where(even, early, late), jnp.where(even, late, early)
    first = jax.lax.ppermute(back_first, axis, [(b, a) for a, b in to_first])
    second = jax.lax.ppermute(back_second, axis, [(b, a) for a, b in to_second])
    return jnp.concatenate([first, second], axis=-3)
