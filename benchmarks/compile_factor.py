"""The default ``steps_per_execution``'s compile rule, measured per model on this machine's devices (issue #80
item 4): fresh trainers, the compilation cache off, each model's

- one-step program's first call with its compile (on an accelerator the memory check compiles it before
  that call: ``CompiledFunctions.compiled_ahead_seconds``), and the fused program's compile, from a default
  fit long enough to fuse (``loop.tuning.Timings`` records both): their ratio is what
  ``loop.tuning.FUSED_COMPILE_FACTORS`` assumes per platform;
- a fresh 1,024-step fit end to end at k=1, k=32 and the default, and the default over the better.

    source .whl-tpu/install.sh && python3 benchmarks/compile_factor.py   # on the chip (about 2 minutes)
    python benchmarks/compile_factor.py --steps 64                        # a smoke test on a CPU
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import flax.linen as nn
import jax
import numpy as np
import optax

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
import steps_per_execution as spe  # noqa: E402
from lm import ByteLM  # noqa: E402

import trainkit as tk  # noqa: E402
from trainkit.distributed import compile_cache  # noqa: E402
from trainkit.loop import tuning  # noqa: E402


class Wide(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = nn.relu(nn.Dense(512)(x))
        return nn.Dense(10)(x)


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.max_pool(nn.relu(nn.Conv(32, (3, 3))(x)), (2, 2), (2, 2))
        x = nn.relu(nn.Conv(64, (3, 3))(x))
        return nn.Dense(10)(x.reshape((x.shape[0], -1)))


#: (name, model, input shape or None for byte tokens, batch): the dispatch MLP (the prior's) first
MODELS = (
    ("MLP 32-64-10, b32", spe.MLP, (32,), 32),
    ("MLP 784-512-512-10, b128", Wide, (784,), 128),
    ("CNN 8x8, b32", CNN, (8, 8, 1), 32),
    ("LM 2 x 64, length 32, b8", lambda: ByteLM(layers=2, d_model=64, heads=2, mlp=256, max_len=32), None, 8),
)


def rows(shape, count: int, rng: np.random.Generator):
    if shape is None:  # next-byte prediction
        tokens = rng.integers(0, 256, (count, 33)).astype(np.int32)
        return tokens[:, :-1], tokens[:, 1:]
    return rng.normal(size=(count, *shape)).astype(np.float32), rng.integers(0, 10, count).astype(np.int32)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1024, help="steps of the end-to-end fits")
    args = parser.parse_args()
    os.environ[compile_cache.ENVIRONMENT] = "off"
    seen: list[tuple[str, float]] = []
    first, fused = tuning.Timings.saw_first_call, tuning.Timings.saw_fused_compile
    record = lambda kind, original: lambda self, s: seen.append((kind, s)) or original(self, s)  # noqa: E731
    tuning.Timings.saw_first_call = record("first", first)  # type: ignore[method-assign]
    tuning.Timings.saw_fused_compile = record("fused", fused)  # type: ignore[method-assign]
    device = jax.devices()[0]
    prior = tuning.prior_compile_factor(device.platform)
    print(f"jax {jax.__version__}, {device.platform} {device.device_kind}; the prior: {prior}")
    print(
        "| model | first call + compile (s) | fused compile (s) | ratio | k=1 / k=32 / default (s) | default / better |"
    )
    print("|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for name, make, shape, batch in MODELS:
        x, y = rows(shape, args.steps * batch, rng)

        def trainer(k, make=make):
            return tk.Trainer(make(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3),
                              strategy="single", steps_per_execution=k)  # fmt: skip

        trainer(1).fit((x[: 2 * batch], y[: 2 * batch]), batch_size=batch, epochs=1, verbose=0)  # the process's firsts
        seconds = {}
        for k in (1, 32, None):
            start = time.perf_counter()
            trainer(k).fit((x, y), batch_size=batch, epochs=1, verbose=0)
            seconds[k] = time.perf_counter() - start
        seen.clear()  # a default fit long enough to fuse: both compiles recorded
        long_x, long_y = np.concatenate([x] * 8), np.concatenate([y] * 8)
        trainer(None).fit((long_x, long_y), batch_size=batch, epochs=1, verbose=0)
        firsts, fuseds = [s for kind, s in seen if kind == "first"], [s for kind, s in seen if kind == "fused"]
        ratio = f"{fuseds[0] / firsts[0]:.2f}" if firsts and fuseds else "(did not fuse)"
        fits = " / ".join(f"{seconds[k]:.2f}" for k in (1, 32, None))
        better = min(seconds[1], seconds[32])
        first_s = f"{firsts[0]:.3f}" if firsts else "-"
        fused_s = f"{fuseds[0]:.3f}" if fuseds else "-"
        print(f"| {name} | {first_s} | {fused_s} | {ratio} | {fits} | {seconds[None] / better:.2f} |", flush=True)


if __name__ == "__main__":
    main()
