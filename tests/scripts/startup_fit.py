"""A small fit for the start-up tests: prints the compilations it ran, the persistent cache's
hits and the seconds from the Trainer's creation to the end of the first step.

    TRAINKIT_COMPILATION_CACHE=DIR python startup_fit.py
"""

import time

import jax
import numpy as np
import optax
from flax import linen as nn
from jax._src import dispatch

import trainkit as tk

compiles, hits = [], []


def listener(event, duration=None, **kwargs):
    if event == dispatch.BACKEND_COMPILE_EVENT:
        compiles.append(kwargs.get("fun_name"))


jax.monitoring.register_event_duration_secs_listener(listener)
jax.monitoring.register_event_listener(
    lambda event, **kwargs: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None
)
x = np.random.default_rng(0).normal(size=(64, 12)).astype(np.float32)
y = (x[:, 0] > 0).astype(np.int32)
created = time.perf_counter()
trainer = tk.Trainer(
    nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(2)]),
    loss="sparse_categorical_crossentropy",
    optimizer=optax.adam(1e-2),
)
first = []
clock = tk.callbacks.LambdaCallback(
    on_train_batch_end=lambda batch, logs=None: first.append(time.perf_counter()) if not first else None
)
trainer.fit((x, y), batch_size=16, epochs=1, verbose=0, callbacks=[clock])
print(f"compiles={len(compiles)} cache_hits={len(hits)} first_step={first[0] - created:.3f}")
