"""``tk.attention``: softmax attention decided and run in one function, whatever runs it (the
Pallas splash kernel on a TPU, cuDNN's fused attention on a GPU, XLA's elsewhere:
:func:`~trainkit.attn.kernels.choose`), and split over a context axis inside a context step
(:mod:`~trainkit.attn.context_axis`).

>>> import jax.numpy as jnp
>>> q = k = v = jnp.ones((1, 4, 2, 8))  # (batch, length, heads, head_dim)
>>> attention(q, k, v, causal=True).shape
(1, 4, 2, 8)
"""

from __future__ import annotations

import contextlib

import jax

from trainkit.attn import context_axis, kernels
from trainkit.core import cost


def attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    causal: bool = False,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    scale: float | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """Softmax attention of ``(batch, length, heads, head_dim)`` arrays (keys and values may have fewer
    heads: grouped), causal or not, ``mask`` / ``bias`` broadcast to ``(batch, heads, q_length, kv_length)``
    as ``jax.nn.dot_product_attention`` takes them; run by the implementation chosen per device and shape
    (``implementation=None``: the Pallas kernel on a TPU, see :mod:`trainkit.attn.kernels`) and
    split over a context axis inside a context step (see :mod:`trainkit.attn.context_axis`). Causal,
    it is traced in :data:`~trainkit.core.cost.CAUSAL_ATTENTION_SCOPE`, so the model's flops count half its
    scores."""
    split = context_axis.active_split()
    choice = kernels.choose(
        query,
        key,
        causal=causal,
        masked=mask is not None or bias is not None,
        implementation=implementation,
        platform=kernels.target_platform(),
        split_size=1 if split is None else split.size,
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
                return kernels.splash_attention(query, key, value, causal=causal, scale=scale, interpret=interpret)
            balanced = causal and context_axis.kernel_balances(query, split)
            context_axis.record(context_axis.AttentionCall("tk.attention", True, balanced=balanced))
            return context_axis.split_kernel(query, key, value, split, causal=causal, scale=scale, interpret=interpret)
        options = {"is_causal": causal, "scale": scale, "mask": mask, "bias": bias}
        return context_axis.split_attention(context_axis.JAX_ATTENTION, "tk.attention", query, key, value, options)
