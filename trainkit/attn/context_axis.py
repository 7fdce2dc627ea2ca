"""Attention split over a context axis by hand: the split ``tk.attention`` (:mod:`.dispatch`) and
any ``jax.nn.dot_product_attention``-like function get inside a context step.

Outside a context step ``tk.attention`` is ``jax.nn.dot_product_attention``. While a step of a
strategy with a context axis (``Hybrid(data=2, context=4)``) is traced, each device keeps its
chunk of the queries, all-gathers the keys and values over the axis (MaxText's default
``all_gather`` way), and masks causally by the chunk's global positions; a mask or bias is split
with the queries. Each query's row of attention is computed whole on one device, so the numbers
are those of one device. Without it the compiler gathers what attention needs from the layout
alone; with it, what is gathered is stated, not found. :mod:`trainkit.attn.reach`
routes Flax's and JAX's own attention here; every call a step's trace reaches is recorded
(:func:`attention_calls`), so a plan says whether its context axis split the model's attention.

>>> import jax, jax.numpy as jnp
>>> q = k = v = jnp.ones((1, 4, 2, 8))  # (batch, length, heads, head_dim)
>>> split_attention(jax.nn.dot_product_attention, "example", q, k, v, {"is_causal": True}).shape  # no split active
(1, 4, 2, 8)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from trainkit.attn import kernels
from trainkit.attn.causal_balance import balanced_causal_attention, balanced_halves, contiguous_halves
from trainkit.core.trace_context import current, under

JAX_ATTENTION = jax.nn.dot_product_attention  # bound before attention.reach can route jax.nn's name here


@dataclasses.dataclass(frozen=True)
class ContextSplit:
    """The mesh and axis a step splits each sequence over, and the axes its rows are split over."""

    mesh: Mesh
    axis: str
    batch_axes: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return int(self.mesh.shape[self.axis])


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One attention call a context step's trace reached: through which door (``tk.attention``,
    ``nn.MultiHeadDotProductAttention``, ...), and whether it was split by hand (else why not)."""

    door: str
    split: bool
    reason: str = ""
    balanced: bool = False  # causal, its score tiles balanced over the devices (trainkit.attn.causal_balance)


@dataclasses.dataclass(frozen=True)
class _Calls:
    """The trace context's part that collects the attention calls a trace reaches."""

    calls: list[AttentionCall]


def context_split(split: ContextSplit) -> contextlib.AbstractContextManager[None]:
    """While a step is traced: :func:`attention` splits over ``split``'s axis (a part of its trace context)."""
    return under(split)


def active_split() -> ContextSplit | None:
    """The context split of the step being traced (``None``: no context axis)."""
    split = current(ContextSplit)
    return None if split is None or split.size == 1 else split


@contextlib.contextmanager
def attention_calls() -> Iterator[list[AttentionCall]]:
    """Collects the attention calls the traces inside the block reach under a context axis.

    >>> with attention_calls() as calls:
    ...     pass
    >>> calls
    []
    """
    calls: list[AttentionCall] = []
    with under(_Calls(calls)):
        yield calls


def record(call: AttentionCall) -> None:
    collecting = current(_Calls)
    if collecting is not None:
        collecting.calls.append(call)


# Arguments whose meaning depends on a query's position in the whole sequence (or on the whole
# array, as a dropout mask does): a call that sets them is left to the compiler.
_POSITIONAL = ("query_seq_lengths", "local_window_size", "module", "return_residual")


def _why_not_split(split: ContextSplit, query: jax.Array, options: Mapping[str, Any]) -> str:
    if query.ndim < 3:
        return f"its queries have shape {query.shape}, not (..., length, heads, head_dim)"
    if query.shape[-3] % split.size:
        return f"its {query.shape[-3]} query positions do not split over the {split.size} devices of the context axis"
    if options.get("dropout_rate", 0.0) and not options.get("deterministic", True):
        return "attention dropout draws its mask for the whole array"
    for name in _POSITIONAL:
        if options.get(name) not in (None, False):
            return f"{name}= depends on positions in the whole sequence"
    for name in ("bias", "mask"):
        if options.get(name) is not None and jnp.ndim(options[name]) > query.ndim:
            return f"its {name} has more dimensions than its queries"
    return ""


def _row_axes(split: ContextSplit, query: jax.Array) -> tuple[str, ...]:
    """The mesh axes the queries' rows are split over inside the split: the step's batch axes, or none
    where they do not divide the rows (a micro-batch: whole on each device)."""
    rows = split.batch_axes
    if rows and query.shape[0] % max(1, math.prod(int(split.mesh.shape[a]) for a in rows)):
        return ()
    return rows


def split_attention(
    attend: Callable[..., jax.Array],
    door: str,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    options: Mapping[str, Any],
) -> jax.Array:
    """``attend(query, key, value, **options)`` (a ``jax.nn.dot_product_attention``-like function
    on ``(..., length, heads, head_dim)`` arrays, ``mask``/``bias`` broadcast to ``(..., heads,
    q_length, kv_length)``), split over the active context axis, or whole where it cannot be
    split exactly (recorded with the reason)."""
    split = active_split()
    if split is None:
        return attend(query, key, value, **options)
    reason = _why_not_split(split, query, options)
    balanced = not reason and _balances(attend, split, query, key, options)
    record(AttentionCall(door, not reason, reason, balanced))
    if reason:
        return attend(query, key, value, **options)
    axis, batch = split.axis, query.ndim - 3
    rows = _row_axes(split, query) if batch else ()
    lead = (rows or None, *[None] * (batch - 1)) if batch else ()
    sequence_spec = PartitionSpec(*lead, axis)
    gathers = key.shape[-3] % split.size == 0  # else (cross-attention to a short memory) whole already
    kv_spec = sequence_spec if gathers else PartitionSpec(*lead)
    arrays = {n: v for n, v in options.items() if n in ("bias", "mask", "key_value_seq_lengths") and v is not None}
    specs = {n: _mask_spec(jnp.shape(v), query, axis, rows) for n, v in arrays.items()}
    if "key_value_seq_lengths" in arrays:
        specs["key_value_seq_lengths"] = PartitionSpec(rows or None)
    causal = bool(options.get("is_causal", False))
    # the arrays split (and a None mask or bias) are passed by local() alone: passed twice they were a TypeError
    fixed = {n: v for n, v in options.items() if n not in ("bias", "mask", "key_value_seq_lengths", "is_causal")}
    if "is_causal" in options:
        fixed["is_causal"] = False  # the causal mask comes from global positions instead

    def local(q: jax.Array, k: jax.Array, v: jax.Array, local_arrays: dict[str, jax.Array]) -> jax.Array:
        if gathers:
            k, v = (jax.lax.all_gather(a, axis, axis=a.ndim - 3, tiled=True) for a in (k, v))
        if balanced:
            return balanced_causal_attention(q, k, v, axis=axis, size=split.size, scale=options.get("scale"))
        if causal:
            start = jax.lax.axis_index(axis) * q.shape[-3]  # this chunk's first global position
            allowed = (start + jnp.arange(q.shape[-3]))[:, None] >= jnp.arange(k.shape[-3])[None, :]
            allowed = allowed.reshape((1,) * (q.ndim - 2) + allowed.shape)
            mask = local_arrays.get("mask")
            local_arrays = {**local_arrays, "mask": allowed if mask is None else jnp.logical_and(mask, allowed)}
        with under(without=(ContextSplit,)):  # an attend that calls tk.attention runs whole here
            return attend(q, k, v, **fixed, **local_arrays)

    run = jax.shard_map(
        local,
        mesh=split.mesh,
        in_specs=(sequence_spec, kv_spec, kv_spec, specs),
        out_specs=sequence_spec,
        axis_names={axis, *rows},
        check_vma=False,
    )
    out: jax.Array = run(query, key, value, arrays)
    return out


def _balances(
    attend: Callable[..., jax.Array], split: ContextSplit, query: jax.Array, key: jax.Array, options: Mapping[str, Any]
) -> bool:
    """Whether a call is plain causal self-attention with JAX's semantics, whose query chunks halve:
    then its tiles are balanced over the devices (:mod:`trainkit.attn.causal_balance`)."""
    plain = all(options.get(name) is None for name in ("bias", "mask", "key_value_seq_lengths", "implementation"))
    return (
        attend is JAX_ATTENTION
        and bool(options.get("is_causal"))
        and plain
        and key.shape[-3] == query.shape[-3]
        and query.shape[-3] % (2 * split.size) == 0
    )


def _mask_spec(shape: tuple[int, ...], query: jax.Array, axis: str, rows: tuple[str, ...]) -> PartitionSpec:
    """A mask's or bias's split: its query-length dimension (second from the end) over the context
    axis where it is not broadcast; its rows with the queries' where it has them."""
    spec: list[str | tuple[str, ...] | None] = [None] * len(shape)
    if len(shape) >= 2 and shape[-2] == query.shape[-3]:
        spec[-2] = axis
    if rows and len(shape) == query.ndim and shape[0] == query.shape[0]:
        spec[0] = rows
    return PartitionSpec(*spec)


def kernel_balances(query: jax.Array, split: ContextSplit) -> bool:
    """Whether the kernel's causal split balances: each chunk's halves are whole blocks."""
    return (query.shape[1] // split.size) % (2 * kernels.BLOCK) == 0


def split_kernel(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    split: ContextSplit,
    *,
    causal: bool,
    scale: float | None,
    interpret: bool,
) -> jax.Array:
    """The Pallas kernel under a context axis: each device's queries against the keys and values
    gathered whole; causal, each query chunk against the prefix it can see, the kernel's causal mask
    offset by the chunk's start (static kernels per position on the axis, chosen by ``lax.switch``).
    Causal and balanced where a chunk's halves are multiples of the kernel's block: device ``d``
    runs half-chunks ``d`` and ``2C-1-d`` (:mod:`trainkit.attn.causal_balance`), ``2C + 1`` half-chunks
    of keys on every device; else its contiguous chunk (the last device sees all ``C`` chunks). The
    chunk must be a multiple of the kernel's block (:func:`~trainkit.attn.kernels.choose` said so)."""
    axis, size = split.axis, split.size
    chunk = query.shape[1] // size
    assert kernels.kernel_splits(query, key, size), "kernels.choose refuses or reroutes such a call"
    rows = _row_axes(split, query)
    spec = PartitionSpec(rows or None, axis)
    balanced = kernel_balances(query, split)

    def prefix(index: int, length: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        """Queries of global chunk ``index`` (of ``length`` rows) against the keys up to their end."""
        end = (index + 1) * length
        return kernels.splash_attention(
            q, k[:, :end], v[:, :end], causal=True, scale=scale, interpret=interpret, offset=index * length
        )

    def pair(position: int, early: jax.Array, late: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        half = chunk // 2
        return jnp.stack([prefix(position, half, early, k, v), prefix(2 * size - 1 - position, half, late, k, v)])

    def local(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        k, v = (jax.lax.all_gather(a, axis, axis=1, tiled=True) for a in (k, v))
        if not causal:
            return kernels.splash_attention(q, k, v, causal=False, scale=scale, interpret=interpret)
        here = jax.lax.axis_index(axis)
        if not balanced:
            branches = [functools.partial(prefix, position, chunk) for position in range(size)]
            out: jax.Array = jax.lax.switch(here, branches, q, k, v)
            return out
        early, late = balanced_halves(q, axis=axis, size=size)
        both = jax.lax.switch(here, [functools.partial(pair, position) for position in range(size)], early, late, k, v)
        return contiguous_halves(both[0], both[1], axis=axis, size=size)

    run = jax.shard_map(
        local, mesh=split.mesh, in_specs=(spec, spec, spec), out_specs=spec, axis_names={axis, *rows}, check_vma=False
    )
    result: jax.Array = run(query, key, value)
    return result
