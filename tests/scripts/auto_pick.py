"""Prints the strategy ``"auto"`` picks for a small CNN on 8 fake devices, and whether it
planned (compiled the candidates) or remembered an earlier run's pick, and how many programs
the run compiled that the persistent compilation cache did not hold (MISSES).

    TRAINKIT_COMPILATION_CACHE=DIR python auto_pick.py
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402

import trainkit as tk  # noqa: E402


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


import jax  # noqa: E402

events = []
jax.monitoring.register_event_listener(lambda event, **kwargs: events.append(event))
rng = np.random.default_rng(0)
x, y = rng.normal(size=(256, 8, 8, 1)).astype(np.float32), rng.integers(0, 10, 256).astype(np.int32)
trainer = tk.Trainer(CNN(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3))
trainer.fit((x, y), batch_size=64, epochs=1, verbose=0)
print("PICK", tk.plan.short_name(trainer.strategy), "planned" if trainer.last_plan is not None else "remembered")
print("MISSES", sum(event.endswith("cache_misses") for event in events))
