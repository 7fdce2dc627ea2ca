"""Remat and gradient-accumulation settings side by side on the benchmark transformer:
compiled temp bytes and steps/s.

For each ``remat=`` / ``grad_accum_steps=`` setting, the real train step of ``tk.Trainer`` (SingleDevice) is lowered
and compiled; ``compiled.memory_analysis()`` gives its temporary (activation) bytes, and a few
real steps, alternated across settings, give steps/s. Ratios are against ``remat=None``.

    python benchmarks/remat.py [--batch 4] [--seq 128] [--steps 3] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from models import TransformerLM, count_params, token_batches  # noqa: E402

import trainkit as tk  # noqa: E402
from trainkit.core.totals import pack  # noqa: E402

# name: (remat, grad_accum_steps)
SETTINGS = {
    "none": (None, 1),
    "full": ("full", 1),
    "dots": ("dots", 1),
    "dots_no_batch": ("dots_no_batch", 1),
    "Block": (["Block"], 1),
    "accum 2": (None, 2),
    "accum 4": (None, 4),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="0: memory only")
    args = parser.parse_args()
    x, y = token_batches(8192, args.batch, args.seq, args.steps)
    trainers, memory = {}, {}
    for name, (remat, accumulation) in SETTINGS.items():
        trainer = tk.Trainer(
            TransformerLM(),
            loss="sparse_categorical_crossentropy",
            optimizer=optax.adamw(1e-3),
            strategy=tk.SingleDevice(),
            remat=remat,
            grad_accum_steps=accumulation,
        )
        state = trainer.init(x[: args.batch])
        host = {"x": x[: args.batch], "y": y[: args.batch], "mask": np.ones(args.batch, np.float32)}
        totals = pack(trainer.compiled.empty_totals("train", host))  # the metric totals the step carries
        compiled = trainer.function("train").lower(state, totals, trainer.strategy.put_batch(host)).compile()
        memory[name] = compiled.memory_analysis()
        trainers[name] = trainer
    params = count_params(trainers["none"].params)
    rates = {name: [float("nan")] for name in trainers}
    if args.repeats:
        for trainer in trainers.values():  # warm up (compile inside fit)
            trainer.fit((x, y), batch_size=args.batch, epochs=1, verbose=0)
        rates = {name: [] for name in trainers}
    for _ in range(args.repeats):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            trainer.fit((x, y), batch_size=args.batch, epochs=1, verbose=0)
            rates[name].append(args.steps / (time.perf_counter() - start))
    print(
        f"TransformerLM: {params / 1e6:.1f}M parameters, batch {args.batch} x {args.seq} tokens, "
        f"jax {jax.__version__}, {os.cpu_count()} cores; median of {args.repeats} alternating repeats"
    )
    header = f"{'setting':14} {'temp MiB':>9} {'temp vs none':>13} {'args MiB':>9} {'steps/s':>8} {'speed vs none':>14}"
    print(header + "\n" + "-" * len(header))
    base_temp, base_rate = memory["none"].temp_size_in_bytes, statistics.median(rates["none"])
    for name in trainers:
        m, rate = memory[name], statistics.median(rates[name])
        print(
            f"{name:14} {m.temp_size_in_bytes / 2**20:9.1f} {m.temp_size_in_bytes / base_temp:13.3f} "
            f"{m.argument_size_in_bytes / 2**20:9.1f} {rate:8.3f} {rate / base_rate:14.3f}"
        )


if __name__ == "__main__":
    main()
