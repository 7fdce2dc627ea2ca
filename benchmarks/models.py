"""Benchmark models shared by the benchmarks: a wide MLP, a small CNN and a decoder-only transformer language model."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np


class MLP(nn.Module):
    """Two hidden layers of 1024 and 10 logits (the memory and prefetch benchmarks' MLP)."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(1024)(x))
        x = nn.relu(nn.Dense(1024)(x))
        return nn.Dense(10)(x)


class CNN(nn.Module):
    """Two 3x3 convolutions with average pooling, a 256 dense layer and 10 logits (the overhead,
    start-up, finder and GPU benchmarks' CNN)."""

    @nn.compact
    def __call__(self, x):
        x = nn.avg_pool(nn.relu(nn.Conv(32, (3, 3))(x)), (2, 2), strides=(2, 2))
        x = nn.avg_pool(nn.relu(nn.Conv(64, (3, 3))(x)), (2, 2), strides=(2, 2))
        return nn.Dense(10)(nn.relu(nn.Dense(256)(x.reshape(x.shape[0], -1))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and an MLP, both residual."""

    d_model: int
    heads: int
    mlp: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, deterministic=True)(nn.LayerNorm()(x), mask=mask)
        x = x + h
        h = nn.Dense(self.mlp)(nn.LayerNorm()(x))
        return x + nn.Dense(self.d_model)(nn.gelu(h))


class TransformerLM(nn.Module):
    """Token ids ``(batch, time)`` -> next-token logits ``(batch, time, vocab)``."""

    vocab: int = 8192
    d_model: int = 512
    layers: int = 6
    heads: int = 8
    mlp: int = 2048
    max_len: int = 256

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        positions = jnp.arange(tokens.shape[1])[None]
        x = nn.Embed(self.vocab, self.d_model)(tokens) + nn.Embed(self.max_len, self.d_model)(positions)
        for _ in range(self.layers):
            x = Block(self.d_model, self.heads, self.mlp)(x, train)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def token_batches(vocab: int, batch: int, seq: int, steps: int, seed: int = 0):
    """Random token sequences and their next-token targets, ``batch * steps`` rows."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(batch * steps, seq + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def count_params(params) -> int:
    import jax

    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
