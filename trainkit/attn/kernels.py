"""The attention ``tk.attention`` runs, chosen per device and shape: on a TPU the Pallas splash
kernel (``jax.experimental.pallas.ops.tpu.splash_attention``, as MaxText and Levanter train with:
scores never written out whole, fully masked blocks of a causal mask skipped), on a GPU cuDNN's
fused attention where it takes the dtype, else XLA's written-out attention
(``jax.nn.dot_product_attention(implementation="xla")``). ``implementation=`` forces one:
``"xla"``, ``"pallas"`` (a TPU), ``"pallas-interpret"`` (the same kernel run by JAX's Pallas
interpreter on any device: slow, for tests), ``"cudnn"`` (a GPU); one that cannot run here, or
cannot take the call, is refused by name. :func:`choose` decides, also under a context axis;
:func:`trainkit.attn.attention` runs what it chose. Where the automatic choice cannot give the kernel a call
(a length not a multiple of its block, a ``mask`` or ``bias``), it routes it to XLA with a
one-line note, never a wrong number.

Arrays are ``(batch, length, heads, head_dim)``; keys and values may have fewer heads than the
queries (grouped heads: the kernel's multi-query form, each key and value head serving its group, no copies).

>>> import jax.numpy as jnp
>>> q = jnp.ones((1, 256, 2, 64))
>>> choose(q, q, causal=True, masked=False, implementation=None, platform="tpu").name
'pallas'
>>> print(choose(q[:, :200], q[:, :200], causal=True, masked=False, implementation=None, platform="tpu").note)
tk.attention: length 200 is not a multiple of the Pallas kernel's block of 128: XLA's attention instead
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from trainkit.core.trace_context import current
from trainkit.core.warn import warn_user

#: the implementations ``tk.attention(implementation=...)`` takes, and the platforms each runs on
IMPLEMENTATIONS = {"xla": None, "pallas": "tpu", "pallas-interpret": None, "cudnn": "gpu"}
#: the splash kernel's smallest block along a sequence (a TPU's lane width)
BLOCK = 128
_NOTED: set[str] = set()


@dataclasses.dataclass(frozen=True)
class Platform:
    """The platform of the devices the step being traced is compiled for (``"tpu"``, ``"gpu"``,
    ``"cpu"``), a part of its trace context: a plan for a TPU slice compiled on a CPU (a
    compile-only target) traces the kernel the slice runs.

    >>> from trainkit.core.trace_context import traced_under
    >>> traced_under(target_platform, Platform("tpu"))()
    'tpu'
    """

    name: str


def target_platform() -> str:
    """The platform the attention being traced runs on: the compiled step's devices' (:class:`Platform`),
    else JAX's default backend."""
    platform = current(Platform)
    return jax.default_backend() if platform is None else platform.name


@dataclasses.dataclass(frozen=True)
class Choice:
    """Which attention runs (``name``), and the note that says why not the kernel (``""``: none)."""

    name: str
    note: str = ""


def choose(
    query: jax.Array,
    key: jax.Array,
    *,
    causal: bool,
    masked: bool,
    implementation: str | None,
    platform: str,
    split_size: int = 1,
    segmented: bool = False,
    windowed: bool = False,
) -> Choice:
    """The attention for a call of these shapes on ``platform`` (``jax.default_backend()``'s name),
    inside a step whose context axis splits each sequence ``split_size`` ways (1: none); ``segmented``
    / ``windowed``: with segment ids or a local window (the kernel takes them, outside a context axis)."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"tk.attention: implementation={implementation!r} is not one of {sorted(IMPLEMENTATIONS)} (or None: "
            "chosen per device and shape)."
        )
    if implementation is None:
        plain = not (masked or segmented or windowed)
        if platform == "gpu" and query.dtype in (jnp.bfloat16, jnp.float16) and plain:
            return Choice("cudnn")
        if platform != "tpu":
            return Choice("xla")
        why = _kernel_refuses(query, key, masked) or _split_refuses(query, key, split_size, segmented or windowed)
        return Choice("xla", f"tk.attention: {why}: XLA's attention instead") if why else Choice("pallas")
    needs = IMPLEMENTATIONS[implementation]
    if needs is not None and platform != needs:
        raise ValueError(
            f"tk.attention: implementation={implementation!r} runs on a {needs.upper()}, and this program is "
            f"compiled for {platform!r}. Pass implementation=None (chosen per device), 'xla', or "
            "'pallas-interpret' (the Pallas kernel interpreted: any device, slowly)."
        )
    if implementation == "cudnn" and (segmented or windowed):
        raise ValueError(
            "tk.attention: implementation='cudnn' takes no segment_ids or window; pass implementation=None."
        )
    if implementation.startswith("pallas"):
        why = _kernel_refuses(query, key, masked)
        if why:
            raise ValueError(f"tk.attention: implementation={implementation!r} cannot take this call: {why}.")
        if _split_refuses(query, key, split_size, segmented or windowed):
            raise ValueError(
                f"tk.attention: the Pallas kernel under a context axis of {split_size} needs self-attention whose "
                f"length splits into chunks of a multiple of {BLOCK}; received queries of length {query.shape[1]} "
                f"and keys of length {key.shape[1]}. Pass implementation=None (XLA's attention, split by hand)."
            )
    return Choice(implementation)


def kernel_splits(query: jax.Array, key: jax.Array, parts: int) -> bool:
    """Whether the kernel takes this self-attention split ``parts`` ways over a context axis (whole blocks each)."""
    length = query.shape[1]
    return key.shape[1] == length and length % parts == 0 and (length // parts) % BLOCK == 0


def _split_refuses(query: jax.Array, key: jax.Array, parts: int, restricted: bool = False) -> str:
    """Why the kernel cannot take a call split ``parts`` ways over a context axis (``""``: it can);
    ``restricted``: with segment ids or a window."""
    if parts == 1:
        return ""
    if restricted:
        return f"segment ids or a window under a context axis of {parts} are not split for the kernel; split by hand"
    if kernel_splits(query, key, parts):
        return ""
    return (
        f"under a context axis of {parts}, queries of length {query.shape[1]} do not split into chunks of a multiple "
        f"of the kernel's block ({BLOCK}); split by hand"
    )


def _kernel_refuses(query: jax.Array, key: jax.Array, masked: bool) -> str:
    """Why the splash kernel cannot take a call (``""``: it can)."""
    if masked:
        return "a mask= or bias= array is not a mask the Pallas kernel takes (causal=True is)"
    if query.ndim != 4:
        return f"queries of shape {query.shape} are not (batch, length, heads, head_dim)"
    for name, length in (("length", query.shape[1]), ("key length", key.shape[1])):
        if length % BLOCK:
            return f"{name} {length} is not a multiple of the Pallas kernel's block of {BLOCK}"
    if query.shape[2] % key.shape[2]:
        return f"{query.shape[2]} query heads are not a multiple of the {key.shape[2]} key and value heads"
    return ""


def note_once(note: str) -> None:
    """A routing note, shown once per process and reason (a step is traced more than once)."""
    if note and note not in _NOTED:
        _NOTED.add(note)
        warn_user(note)


def block_size(length: int) -> int:
    """The largest of 512, 256, 128 that divides ``length`` (the kernel's tile along a sequence)."""
    return next(block for block in (512, 256, BLOCK) if length % block == 0)


@functools.cache
def _kernel(
    heads: int,
    q_length: int,
    kv_length: int,
    causal: bool,
    interpret: bool,
    offset: int = 0,
    window: tuple[int, int] | None = None,
    shared_kv: bool = False,
) -> Callable[..., jax.Array]:
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    shape = (q_length, kv_length)
    if window is not None:  # the keys within (left, right) of each query (right 0: causal)
        head_mask: masks.Mask = masks.LocalMask(shape, (window[0], 0 if causal else window[1]), offset)
    else:
        head_mask = masks.CausalMask(shape, offset=offset) if causal else masks.FullMask(shape)
    bq, bkv = block_size(q_length), block_size(kv_length)
    sizes = splash.BlockSizes(
        block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv,
    )  # fmt: skip
    mask = masks.MultiHeadMask([head_mask] * heads)
    with jax.ensure_compile_time_eval():  # its block tables concrete arrays, kept across traces (cached)
        make = splash.make_splash_mqa_single_device if shared_kv else splash.make_splash_mha_single_device
        kernel: Callable[..., jax.Array] = make(mask, block_sizes=sizes, interpret=interpret)
    return kernel


def splash_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    causal: bool,
    scale: float | None,
    interpret: bool,
    offset: int = 0,
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
    window: tuple[int, int] | None = None,
) -> jax.Array:
    """Softmax attention of ``(batch, length, heads, head_dim)`` arrays by the splash kernel (each
    row of the batch through the kernel; grouped heads, fewer key and value heads than the queries',
    by its multi-query form, each key and value head serving its group of query heads without a copy);
    ``offset``: the queries' first position among the keys' (a causal chunk of a longer sequence);
    ``segment_ids``: the queries' and the keys' ``(batch, length)`` ids (the kernel's ``SegmentIds``);
    ``window``: the keys ``(left, right)`` of each query it sees (the kernel's ``LocalMask``)."""
    batch, length, heads, depth = query.shape
    kv_heads = key.shape[2]
    groups = heads // kv_heads
    scale = 1.0 / math.sqrt(depth) if scale is None else scale
    kernel = _kernel(
        groups if groups > 1 else heads, length, key.shape[1], causal, interpret, offset, window, groups > 1
    )
    to_heads = functools.partial(jnp.swapaxes, axis1=1, axis2=2)  # (batch, heads, length, head_dim)
    q, k, v = to_heads((query * np.asarray(scale, query.dtype)).astype(query.dtype)), to_heads(key), to_heads(value)
    ids = None
    if segment_ids is not None:
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

        ids = splash.SegmentIds(q=segment_ids[0], kv=segment_ids[1])

    def row(q: jax.Array, k: jax.Array, v: jax.Array, ids: object) -> jax.Array:
        if groups == 1:
            return kernel(q, k, v, segment_ids=ids)
        grouped = q.reshape(kv_heads, groups, length, depth)  # query head h serves key head h // groups
        out = jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=ids))(grouped, k, v)
        return out.reshape(heads, length, depth)

    # one more vmap, of size 1: the same numbers, and XLA's TPU layout assignment then reads the kernel's float32
    # logsumexp residual (lane-replicated, (batch, heads, length, 128)) where it lies instead of copying it whole
    # into another layout to slice its first lane: 325 -> 195 MiB of temporaries for 4 rows of 8,192 tokens, 8 heads
    # of 128 (a v5e's compiler; tests/test_targets.py)
    one = functools.partial(jax.tree.map, lambda a: a[None])
    out = jax.vmap(jax.vmap(row))(*one((q, k, v, ids)))[0]
    return to_heads(out).astype(query.dtype)
