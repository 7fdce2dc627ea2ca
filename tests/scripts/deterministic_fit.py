"""Trains with ``deterministic=True`` under ``"auto"`` (two candidates) on 8 fake CPU devices (dropout,
BatchNorm, shuffling) and writes the parameters and the XLA flags to OUT.npz."""

import os
import sys

import flax.linen as nn
import jax
import numpy as np
import optax

import trainkit as tk


class Noisy(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.BatchNorm(use_running_average=not train)(nn.Dense(64)(x))
        x = nn.Dropout(0.3, deterministic=not train)(nn.relu(x))
        return nn.Dense(4)(x)


trainer = tk.Trainer(
    Noisy(),
    loss="sparse_categorical_crossentropy",
    optimizer=optax.adam(1e-2),
    strategy=tk.strategies.Auto(candidates=[tk.DataParallel(), tk.FSDP()]),  # timed by default: ranked by estimate
    deterministic=True,
    seed=5,
)
rng = np.random.default_rng(0)
x, y = rng.normal(size=(512, 16)).astype(np.float32), rng.integers(0, 4, 512)
trainer.fit(x, y, batch_size=64, epochs=3, verbose=0)
leaves = jax.tree_util.tree_leaves_with_path(trainer.get_weights())
np.savez(
    sys.argv[1],
    xla_flags=os.environ.get("XLA_FLAGS", ""),
    strategy=trainer.strategy.describe(),
    **{jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves},
)
