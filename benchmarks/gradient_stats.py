"""The cost of ``GradientStats`` when it measures rarely: steps/s of ``fit`` with
``GradientStats(every=100)`` (global norms, and per module with ``per_layer=".*"``) against the
same ``fit`` without it, on a dispatch-bound model (an MLP 32-64-10, batch 32, one CPU device:
the host loop is the cost) and on a compute-bound one (an MLP 784-512-512-10, batch 128).
Measured side by side, alternating, in one run; reported as time ratios (with / without), with
a second trainer without statistics as the noise floor. Target: at most 1.05x at every=100.
A dispatch-bound run of 1,000 steps lasts 0.2 s, and on a shared 2-core machine one round's
ratio ranges 0.7-1.7: its case takes ``--repeats`` x 6 rounds (the median of the paired ratios).

A second table times a first ``fit`` in a fresh process, compiles included (JAX's persistent
cache off): ``every=100`` compiles two train programs (one that measures, called on the due
steps; one that does not), ``every=1`` only the one that measures.

    python benchmarks/gradient_stats.py [--repeats 5] [--steps 1000] [--first-fits 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from timing import measure_rounds, paired_ratio  # noqa: E402

import trainkit as tk  # noqa: E402

TARGET = 1.05


class MLP(nn.Module):
    widths: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        for width in self.widths[:-1]:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.widths[-1])(x)


#: name: (widths, features, batch, rounds per --repeats)
CASES = {
    "dispatch-bound MLP 32-64-10, batch 32": ((64, 10), 32, 32, 6),
    "MLP 784-512-512-10, batch 128": ((512, 512, 10), 784, 128, 1),
}


def contender(widths: tuple[int, ...], x: np.ndarray, y: np.ndarray, batch: int, callbacks) -> Callable[[], None]:
    """One epoch of ``fit`` over ``x`` with fresh ``callbacks()``, compiled before it is timed:
    fits for 3 s first (the step that measures nothing between the due steps is compiled only
    once the steps have run as long as the measuring step's compile took: trainkit/loop/measuring.py)."""
    trainer = tk.Trainer(
        MLP(widths), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3), strategy="single"
    )

    def run() -> None:
        trainer.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=callbacks())

    warm_until = time.perf_counter() + 3.0
    while time.perf_counter() < warm_until:
        run()

    return run


#: the first fits timed: the callbacks of each (every=None: without GradientStats)
FIRST_FITS = {"without": None, "every=100": 100, "every=1": 1}


def first_fit(every: int | None, steps: int) -> float:
    """Seconds of a fresh trainer's first ``fit`` (compiles included) on the dispatch-bound MLP."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32 * steps, 32)).astype(np.float32)
    y = rng.integers(0, 10, len(x)).astype(np.int32)
    trainer = tk.Trainer(MLP((64, 10)), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3),
                         strategy="single", steps_per_execution=1)  # fmt: skip
    callbacks = [] if every is None else [tk.callbacks.GradientStats(every=every)]
    start = time.perf_counter()
    trainer.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=callbacks)
    return time.perf_counter() - start


def first_fits(rounds: int, steps: int) -> None:
    """Each kind's first fit in its own process, alternating, ``rounds`` times: median ratios."""
    env = os.environ | {"TRAINKIT_COMPILATION_CACHE": "off"}
    seconds: dict[str, list[float]] = {kind: [] for kind in FIRST_FITS}
    for _ in range(rounds):
        for kind in FIRST_FITS:
            command = [sys.executable, __file__, "--first-fit", kind, "--steps", str(steps)]
            done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
            seconds[kind].append(float(done.stdout.split()[-1]))
    base = statistics.median(seconds["without"])
    print(f"first fit of {steps} steps in a fresh process (compiles included), median of {rounds}:")
    for kind, times in seconds.items():
        print(f"  {kind:10s} {statistics.median(times):.2f} s  x{statistics.median(times) / base:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--first-fits", type=int, default=6)
    parser.add_argument("--first-fit", choices=list(FIRST_FITS), help=argparse.SUPPRESS)  # one, in this process
    args = parser.parse_args()
    if args.first_fit is not None:
        print(first_fit(FIRST_FITS[args.first_fit], args.steps))
        return 0
    print(f"GradientStats(every=100), {args.steps} steps a run, {args.repeats} paired rounds; time with / without")
    for name, (widths, features, batch, rounds_per_repeat) in CASES.items():
        rng = np.random.default_rng(0)
        x = rng.normal(size=(batch * args.steps, features)).astype(np.float32)
        y = rng.integers(0, widths[-1], len(x)).astype(np.int32)
        contenders = {
            "without": contender(widths, x, y, batch, lambda: []),
            "without, again": contender(widths, x, y, batch, lambda: []),  # the noise floor: a second trainer
            "global": contender(widths, x, y, batch, lambda: [tk.callbacks.GradientStats(every=100)]),
            "per module": contender(
                widths, x, y, batch, lambda: [tk.callbacks.GradientStats(every=100, per_layer=".*")]
            ),
        }
        rounds = measure_rounds(contenders, args.steps, args.repeats * rounds_per_repeat)
        for kind in ("without, again", "global", "per module"):
            ratio = 1 / paired_ratio(rounds, kind, "without")  # time ratio: rates inverted
            verdict = "meets" if ratio <= TARGET else "misses"
            print(f"{name:40s} {kind:14s} x{ratio:.3f}  ({verdict} the {TARGET}x target)")
    if args.first_fits:
        first_fits(args.first_fits, args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
