"""``tk.attention``: softmax attention decided and run in one function, whatever runs it (the
Pallas splash kernel on a TPU, cuDNN's fused attention on a GPU, XLA's elsewhere:
:func:`~trainkit.attn.kernels.choose`), and split over a context axis inside a context step
(:mod:`~trainkit.attn.context_axis`).

``segment_ids``: documents packed into one row (MaxText's, Levanter's and grain's packing): an integer
``(batch, length)`` array, a token attending only to tokens of its own id (causal within it); padding
is a segment of its own (give it an id no document has, e.g. 0), its outputs unread. Self-attention
takes one array; attention over other keys a pair ``(query_ids, key_ids)``. The Pallas kernel takes
them on a TPU (its ``SegmentIds``: the scores never written out); elsewhere they are a mask on XLA's
attention, with the same numbers. Beside ``jax.nn.dot_product_attention``'s ``query_seq_lengths`` /
``key_value_seq_lengths`` (a padded tail per row), they also separate documents.

``window``: local (sliding-window) attention, as Mistral's and Gemma's layers use: each query sees the
keys at most ``left`` positions before it and ``right`` after (an int: the same both sides; causal:
none after), as ``jax.nn.dot_product_attention``'s ``local_window_size``; the kernel's ``LocalMask``
on a TPU, XLA's attention elsewhere, the same numbers.

``mask``: where a query may attend, read by its rank as Keras writes it, so a batch as long as the
sequence is never ambiguous: ``(batch, S)`` a key padding mask, ``(batch, 1, S)`` or ``(batch, T, S)``
the same for every head, ``(batch, heads, T, S)`` (or any array broadcasting to it) as it is; bool, or
int / float 0/1 (kept where not 0, as Keras casts it). An additive mask (0 where kept, -inf where not)
belongs in ``bias=``: one given as ``mask=`` as a constant is refused by name.

Causal attention over keys of another length than the queries says how they align: ``causal=
"bottom_right"`` (the last query sees every key: a decoder reading a cache) or ``"top_left"`` (the
first query sees the first key, ``jax.nn.dot_product_attention``'s ``is_causal``); ``causal=True``
there is refused by name (it aligned top-left without a word: greedy decoding read the wrong keys).

>>> import jax.numpy as jnp
>>> q = k = v = jnp.ones((1, 4, 2, 8))  # (batch, length, heads, head_dim)
>>> attention(q, k, v, causal=True).shape
(1, 4, 2, 8)
>>> documents = jnp.array([[1, 1, 2, 2]])  # two documents packed in one row: none sees the other
>>> attention(q, k, v, causal=True, segment_ids=documents).shape
(1, 4, 2, 8)
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from trainkit.attn import context_axis, kernels
from trainkit.core import cost


def attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    causal: bool | str = False,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    scale: float | None = None,
    implementation: str | None = None,
    segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
    window: int | tuple[int, int] | None = None,
) -> jax.Array:
    """Softmax attention of ``(batch, length, heads, head_dim)`` arrays (keys and values may have fewer
    heads: grouped), causal or not, ``mask`` / ``bias`` broadcast to ``(batch, heads, q_length, kv_length)``
    as ``jax.nn.dot_product_attention`` takes them; run by the implementation chosen per device and shape
    (``implementation=None``: the Pallas kernel on a TPU, see :mod:`trainkit.attn.kernels`) and
    split over a context axis inside a context step (see :mod:`trainkit.attn.context_axis`). Causal,
    it is traced in :data:`~trainkit.core.cost.CAUSAL_ATTENTION_SCOPE`, so the model's flops count half its
    scores. ``mask`` in Keras's shapes and dtypes, ``segment_ids``, ``window`` and a ``causal`` alignment:
    see the module."""
    mask = _as_mask(mask, query, key)
    ids = _segment_ids(segment_ids, query, key)
    local = _window(window, key)
    offset = _causal_offset(causal, query, key, local)  # the first query's position among the keys
    causal = bool(causal)
    split = context_axis.active_split()
    choice = kernels.choose(
        query,
        key,
        causal=causal,
        masked=mask is not None or bias is not None,
        implementation=implementation,
        platform=kernels.target_platform(),
        split_size=1 if split is None else split.size,
        segmented=ids is not None,
        windowed=local is not None or bool(offset),  # a band the kernel takes and cuDNN does not
    )
    kernels.note_once(choice.note)
    with jax.named_scope(cost.CAUSAL_ATTENTION_SCOPE) if causal else contextlib.nullcontext():
        if choice.name == "cudnn":
            out: jax.Array = context_axis.JAX_ATTENTION(
                query, key, value, bias, mask, scale=scale, is_causal=causal, implementation="cudnn"
            )
            return out
        if choice.name.startswith("pallas"):
            interpret = choice.name == "pallas-interpret"
            if split is None:
                return kernels.splash_attention(
                    query,
                    key,
                    value,
                    causal=causal,
                    scale=scale,
                    interpret=interpret,
                    segment_ids=ids,
                    window=local,
                    offset=offset,
                )
            balanced = causal and context_axis.kernel_balances(query, split)
            context_axis.record(context_axis.AttentionCall("tk.attention", True, balanced=balanced))
            return context_axis.split_kernel(query, key, value, split, causal=causal, scale=scale, interpret=interpret)
        if ids is not None:  # a mask of (batch, 1, q_length, kv_length): split with the queries under a context axis
            same = ids[0][:, None, :, None] == ids[1][:, None, None, :]
            mask = same if mask is None else jnp.logical_and(mask, same)
        if offset:  # bottom-right: query i sees the keys up to i + offset
            seen = jnp.arange(key.shape[1])[None, :] <= jnp.arange(query.shape[1])[:, None] + offset
            mask, causal = (seen if mask is None else jnp.logical_and(mask, seen)), False
        options = {"is_causal": causal, "scale": scale, "mask": mask, "bias": bias, "local_window_size": local}
        return context_axis.split_attention(context_axis.JAX_ATTENTION, "tk.attention", query, key, value, options)


def _segment_ids(
    given: jax.Array | tuple[jax.Array, jax.Array] | None, query: jax.Array, key: jax.Array
) -> tuple[jax.Array, jax.Array] | None:
    """``(query_ids, key_ids)`` checked against the queries' and keys' ``(batch, length)`` (``None``: none given)."""
    if given is None:
        return None
    pair = tuple(jnp.asarray(ids) for ids in given) if isinstance(given, (tuple, list)) else (jnp.asarray(given),) * 2
    if len(pair) != 2:
        raise ValueError(
            f"tk.attention: segment_ids is one array or a pair (query_ids, key_ids); received {len(pair)}."
        )
    for ids, of, what in ((pair[0], query, "queries"), (pair[1], key, "keys")):
        expected = (of.shape[0], of.shape[1])
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(
                f"tk.attention: segment_ids are integer document ids, one per token; received dtype {ids.dtype}. "
                "Give each packed document its own id (int32), padding an id of its own (e.g. 0)."
            )
        if tuple(ids.shape) != expected:
            raise ValueError(
                f"tk.attention: segment_ids for the {what} have shape {tuple(ids.shape)}; they need one id per "
                f"token, (batch, length) = {expected}. Attention over keys of another length takes a pair "
                "(query_ids, key_ids)."
            )
    return pair[0].astype(jnp.int32), pair[1].astype(jnp.int32)


def _window(given: int | tuple[int, int] | None, key: jax.Array) -> tuple[int, int] | None:
    """``(left, right)`` checked: whole numbers, none past the keys' length (``None``: no window)."""
    if given is None:
        return None
    pair = (given, given) if isinstance(given, int) else tuple(given)
    if len(pair) != 2 or not all(isinstance(side, int) and side >= 0 for side in pair):
        raise ValueError(
            f"tk.attention: window is the keys a query sees before and after it, an int or (left, right) of whole "
            f"numbers; received {given!r}."
        )
    length = key.shape[1]
    if max(pair) >= length:
        raise ValueError(
            f"tk.attention: window={given!r} reaches past the {length} keys of the sequence: it would mask nothing. "
            f"Pass a window shorter than the sequence (at most {length - 1}), or window=None for full attention."
        )
    return int(pair[0]), int(pair[1])


#: how a causal call over keys of another length than the queries aligns them (``causal=`` spellings)
ALIGNMENTS = ("top_left", "bottom_right")


def _causal_offset(causal: bool | str, query: jax.Array, key: jax.Array, window: tuple[int, int] | None) -> int:
    """The first query's position among the keys of a causal call (0: aligned top-left, or not causal)."""
    if isinstance(causal, str) and causal not in ALIGNMENTS:
        raise ValueError(f"tk.attention: causal={causal!r} is not True, False or one of {ALIGNMENTS}.")
    queries, keys = query.shape[1], key.shape[1]
    if causal is True and queries != keys:
        raise ValueError(
            f"tk.attention: causal=True with {queries} queries and {keys} keys does not say how they align. Pass "
            "causal='bottom_right' (the last query sees every key: a decoder reading a cache) or causal='top_left' "
            "(the first query sees the first key, as jax.nn.dot_product_attention's is_causal)."
        )
    offset = keys - queries if causal == "bottom_right" else 0
    if offset < 0:
        raise ValueError(
            f"tk.attention: causal='bottom_right' with {queries} queries and fewer keys ({keys}) leaves the first "
            f"{-offset} queries no key to see. Pass as many keys as queries or more, or causal='top_left'."
        )
    if offset and window is not None:
        raise ValueError(
            "tk.attention: window= with causal='bottom_right' over more keys than queries is not supported."
        )
    return offset


def _as_mask(mask: jax.Array | None, query: jax.Array, key: jax.Array) -> jax.Array | None:
    """``mask`` as a bool ``(batch | 1, heads | 1, T | 1, S)`` array, read by its rank (see the module)."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    batch, keys = query.shape[0], key.shape[1]
    if mask.ndim == 2:
        if mask.shape != (batch, keys):
            raise ValueError(
                f"tk.attention: a mask of rank 2 is a key padding mask, (batch, S) = {(batch, keys)} as Keras reads "
                f"it; received {mask.shape}. A mask over positions (T, S) is mask[None, None]."
            )
        mask = mask[:, None, None, :]
    elif mask.ndim == 3:
        mask = mask[:, None]  # (batch, T or 1, S): the same for every head
    if mask.dtype != jnp.bool_:
        if not jnp.issubdtype(mask.dtype, jnp.number):
            raise ValueError(f"tk.attention: mask= takes bool or 0/1 numbers; received dtype {mask.dtype}.")
        if not _zeros_and_ones(mask):
            raise ValueError(
                "tk.attention: mask= holds values other than 0 and 1 (an additive mask, 0 where kept and -inf "
                "where not?): pass it as bias=, or a 0/1 (bool) mask as mask=."
            )
        mask = mask != 0
    return mask


def _zeros_and_ones(mask: jax.Array) -> bool:
    """Whether a numeric mask holds only 0 and 1 (``True`` for a traced one, whose values are not known yet)."""
    try:
        values = np.asarray(mask)
    except jax.errors.TracerArrayConversionError:
        return True
    return bool(np.all((values == 0) | (values == 1)))
