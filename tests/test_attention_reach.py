"""Attention a model already calls, split over a context axis without editing the model (#62):
Flax's ``nn.MultiHeadDotProductAttention`` and ``nn.dot_product_attention``, ``jax.nn``'s, and
``tk.attention``; each split gives one device's numbers (outputs and gradients), and what the trace
reached is recorded, so a plan says when a model's attention was not split."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import attention_written_out
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import trainkit as tk
from trainkit.attn import ContextSplit, attention_calls
from trainkit.attn.causal_balance import tiles_per_device
from trainkit.attn.reach import reaching_attention

B, T, H, D = 2, 16, 2, 8


padding = jnp.arange(T)[None, :] < jnp.array([[T], [T - 5]])  # the second row's last 5 keys are padding
DOORS = {
    "tk.attention": lambda q, k, v: tk.attention(q, k, v, causal=True),
    "jax.nn.dot_product_attention": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
    "jax.nn with a padding mask and a bias": lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, bias=jnp.linspace(0, 1, T * T).reshape(1, 1, T, T), mask=padding[:, None, None, :], is_causal=True
    ),
    "nn.dot_product_attention": lambda q, k, v: nn.dot_product_attention(
        q, k, v, mask=nn.make_causal_mask(jnp.ones((B, T)))
    ),
    "written out": attention_written_out,
}
DOOR_NAMES = {
    "tk.attention": "tk.attention",
    "jax.nn.dot_product_attention": "jax.nn.dot_product_attention",
    "jax.nn with a padding mask and a bias": "jax.nn.dot_product_attention",
    "nn.dot_product_attention": "nn.dot_product_attention",
}


def _inputs():
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32) for _ in range(3)]


def _split_and_whole(attend):
    """Outputs and gradients with each sequence split over a context axis of 4 (rows over 2), and whole."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "context"))
    split = NamedSharding(mesh, PartitionSpec("data", "context"))

    def loss(q, k, v):
        out = attend(q, k, v)
        return jnp.sum(out * jnp.cos(out)), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    inputs = _inputs()
    whole = step(*inputs)
    with attention_calls() as calls, reaching_attention(ContextSplit(mesh, "context", ("data",))):
        splits = jax.jit(
            jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), in_shardings=(split, split, split)
        ).lower(*inputs)
    return jax.device_get(splits.compile()(*inputs)), jax.device_get(whole), calls, splits.as_text()


@pytest.mark.parametrize("door", list(DOORS))
def test_each_door_splits_over_the_context_axis_and_gives_one_devices_numbers(door):
    got, want, calls, text = _split_and_whole(DOORS[door])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if door == "written out":
        assert calls == []  # nothing reached: the compiler gathers what it needs from the layout
    else:
        assert [(c.door, c.split) for c in calls] == [(DOOR_NAMES[door], True)]
        assert calls[0].balanced == (door in ("tk.attention", "jax.nn.dot_product_attention"))  # plain causal
        assert "all_gather" in text  # keys and values gathered by hand over the context axis


class MultiHead(nn.Module):
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, train=False):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        return nn.MultiHeadDotProductAttention(num_heads=H, dropout_rate=self.dropout)(
            x, mask=mask, deterministic=not train
        )


def test_flaxs_multi_head_attention_is_reached_through_an_interceptor_and_left_as_it_was():
    module = MultiHead()
    x = _inputs()[0].reshape(B, T, H * D)
    params = module.init(jax.random.key(0), x)
    got, want, calls, _ = _split_and_whole(lambda q, k, v: module.apply(params, q.reshape(B, T, H * D)))
    np.testing.assert_allclose(got[0][1], want[0][1], rtol=1e-5, atol=1e-6)
    assert [(c.door, c.split) for c in calls] == [("nn.MultiHeadDotProductAttention", True)]
    assert nn.MultiHeadDotProductAttention(num_heads=1).attention_fn is nn.dot_product_attention
    assert jax.nn.dot_product_attention.__module__.startswith("jax")  # the routing is put back
    assert not hasattr(jax.nn.dot_product_attention, "__wrapped__")


def test_attention_dropout_is_left_to_the_compiler_and_recorded_with_the_reason():
    module = MultiHead(dropout=0.5)
    x = _inputs()[0].reshape(B, T, H * D)
    params = module.init(jax.random.key(0), x)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "context"))
    with attention_calls() as calls, reaching_attention(ContextSplit(mesh, "context", ("data",))):
        jax.jit(lambda x: module.apply(params, x, train=True, rngs={"dropout": jax.random.key(1)})).lower(x)
    assert [(c.split, c.reason) for c in calls] == [(False, "attention dropout draws its mask for the whole array")]


def test_causal_attention_balanced_over_the_devices_computes_about_half_the_scores():
    """Balanced, every device computes 2C+1 of the 4C score tiles of its whole block (9 of 16 at C=4):
    the compiled forward's flops, against the same causal attention with its mask as an array."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "context"))
    split = NamedSharding(mesh, PartitionSpec("data", "context"))
    q = jnp.ones((B, 256, H, 64))  # heads of 64: the score and value products dominate, as in a real model
    causal_mask = nn.make_causal_mask(jnp.ones((B, 256)))
    flops = {}
    for name, attend in {
        "balanced": lambda q: tk.attention(q, q, q, causal=True),
        "whole blocks": lambda q: nn.dot_product_attention(q, q, q, mask=causal_mask),
    }.items():
        with reaching_attention(ContextSplit(mesh, "context", ("data",))):
            compiled = jax.jit(attend, in_shardings=split).lower(q).compile()
        flops[name] = compiled.cost_analysis()["flops"]
    tiles, whole = tiles_per_device(4)
    assert flops["balanced"] <= (tiles / whole + 0.1) * flops["whole blocks"], flops
