"""Prints this process's ``find_batch_size`` answer (FSDP over every device of every process,
an explicit memory limit): ``python -m trainkit.launch --nproc 2 --devices-per-proc 4 find_batch_size.py LIMIT``.
With ``fit`` after the limit, it then trains at that batch size and prints the persistent
compilation cache's hits and misses of the fit."""

import sys

import flax.linen as nn
import jax
import numpy as np
import optax

import trainkit as tk


class Wide(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8)(nn.relu(nn.Dense(256)(nn.relu(nn.Dense(256)(x)))))


trainer = tk.Trainer(Wide(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3), strategy="fsdp")
rng = np.random.default_rng(0)
x, y = rng.normal(size=(2**14, 64)).astype(np.float32), rng.integers(0, 8, 2**14)  # as many rows as the largest size
result = trainer.find_batch_size(x, y, memory_limit=int(sys.argv[1]), max_batch_size=2**14, verbose=0)
print(f"process {jax.process_index()} of {jax.process_count()}: batch_size={result.batch_size} needed={result.needed}")
if sys.argv[2:] == ["fit"]:
    events = []
    jax.monitoring.register_event_listener(lambda event, **kwargs: events.append(event))
    trainer.fit(np.resize(x, (result.batch_size, 64)), np.resize(y, result.batch_size), batch_size=result.batch_size)
    print(
        "fit cache hits",
        sum(e.endswith("cache_hits") for e in events),
        "misses",
        sum(e.endswith("cache_misses") for e in events),
    )
