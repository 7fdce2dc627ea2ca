"""Data loading hidden behind compute: ``fit``'s throughput with slow loaders against the
compute-only loop (the same ``fit`` on in-memory arrays), with trainkit's background prefetch on
(the default, 8 batches ahead) and off (``trainer.loop.prefetch = 0``: batches are read in the
main thread, one step ahead, as before the prefetch existed).

Loaders, each a Python iterable of the same NumPy batches, whose time per batch is a fraction of
the measured step time ``t``: constant (a sleep of 0.5 t and 0.9 t: I/O), jittery (a sleep
drawn uniformly from 0 to 1.8 t, 0.9 t on average), and CPU-heavy (Python code holding the GIL
for 0.5 t or 0.9 t per batch), read in trainkit's thread or by a worker process
(``RandomAccessSource(workers=1)``), and the jittery loader as a one-shot generator (read
ahead by its source, with what a stop leaves handed back; "no prefetch" reads it in the main
thread, as trainkit did before).

An accelerator computes without the host's cores; to model that on a CPU, the step's threads
(XLA's pool, created at start) are pinned to all cores but the last, the "device", and the host
(the main thread, the prefetch thread, the workers) to the last core. Throughput is steps/s in
steady state (from batch 20 to the end of one epoch, so a worker pool's start-up is reported
apart), the median of alternating repeats, as a ratio to the compute-only loop in the same run.

    python benchmarks/prefetch.py [--repeats 5] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
CORES = sorted(os.sched_getaffinity(0))
DEVICE_CORES, HOST_CORES = set(CORES[:-1]) or set(CORES), {CORES[-1]}
os.sched_setaffinity(0, DEVICE_CORES)  # XLA's threads, created with the client, stay there

import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import MLP  # noqa: E402

import trainkit as tk  # noqa: E402
from trainkit.data import iterable  # noqa: E402

WARM = 20  # batches before the clock starts
PREFETCH = tk.loop.Loop.prefetch


class Clock(tk.callbacks.Callback):
    """Steps/s from batch ``WARM`` on (dispatch times; at most two steps are in flight)."""

    async_safe = True

    def on_train_batch_begin(self, batch, logs=None):
        if batch == WARM:
            self.started = time.perf_counter()
        self.last = batch

    def on_train_end(self, logs=None):  # every step has finished
        self.rate = (self.last + 1 - WARM) / (time.perf_counter() - self.started)


def busy(seconds: float) -> None:
    """Python work holding the GIL (a decode written in Python)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Loader:
    """The batches of ``(x, y)`` in order, each after ``delay()`` seconds of sleep (or busy work)."""

    def __init__(self, x, y, batch, delay, cpu=False):
        self.x, self.y, self.batch, self.delay, self.cpu = x, y, batch, delay, cpu

    def __len__(self):
        return len(self.x) // self.batch

    def __iter__(self):
        rng = np.random.default_rng(0)
        for lo in range(0, len(self.x), self.batch):
            wait = self.delay(rng, lo // self.batch)
            busy(wait) if self.cpu else time.sleep(wait)
            yield self.x[lo : lo + self.batch], self.y[lo : lo + self.batch]


class Jitter:
    """Waits drawn uniformly from ``[0, high)`` in antithetic pairs ``(u, high - u)``: the mean of
    every two batches is exactly ``high / 2``, so a short run does not draw a slower loader."""

    def __init__(self, high: float):
        self.high, self.last = high, 0.0

    def __call__(self, rng, index: int) -> float:
        self.last = rng.uniform(0, self.high) if index % 2 == 0 else self.high - self.last
        return self.last


class DecodedRows:
    """Random access to rows, each costing ``cost`` seconds of Python work (for worker processes)."""

    def __init__(self, x, y, cost):
        self.x, self.y, self.cost = x, y, cost

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        busy(self.cost)
        return self.x[i], self.y[i]


class OneShot:
    """A one-shot generator over a :class:`Loader` (``iter(loader)``): trainkit reads it ahead
    in a thread and hands back what a stop leaves; ``prefetch=0`` in :func:`run` reads it in
    the main thread instead, one batch at a time (trainkit before the read-ahead)."""

    def __init__(self, loader: Loader):
        self.loader = loader


def run(trainer, data, prefetch, **options):
    trainer.loop.prefetch = prefetch
    clock = Clock()
    started = time.perf_counter()
    if isinstance(data, OneShot):
        generator = iter(data.loader)
        if not prefetch:  # no backlog kept with the generator: read in the main thread
            previous = iterable.backlog_of
            iterable.backlog_of = lambda iterator: iterable.Backlog()
        try:
            trainer.fit(generator, epochs=1, shuffle=False, verbose=0, callbacks=[clock], **options)
        finally:
            if not prefetch:
                iterable.backlog_of = previous
    else:
        trainer.fit(data, epochs=1, shuffle=False, verbose=0, callbacks=[clock], **options)
    return clock.rate, time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    n = args.batch * args.steps
    x = rng.normal(size=(n, 512)).astype(np.float32)
    y = rng.integers(0, 10, n).astype(np.int32)
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3))
    run(trainer, (x, y), PREFETCH, batch_size=args.batch)  # compile (the XLA client exists now)
    os.sched_setaffinity(0, HOST_CORES)  # the host's threads and worker processes from here on
    step = 1.0 / statistics.median(run(trainer, (x, y), PREFETCH, batch_size=args.batch)[0] for _ in range(3))
    print(
        f"compute-only step: {step * 1e3:.1f} ms (MLP 512-1024-1024-10, batch {args.batch}, 1 CPU device "
        f"on core(s) {sorted(DEVICE_CORES)}, the host on core {sorted(HOST_CORES)})"
    )
    cases = {
        "constant 0.5 t (sleep)": lambda: Loader(x, y, args.batch, lambda r, i: 0.5 * step),
        "constant 0.9 t (sleep)": lambda: Loader(x, y, args.batch, lambda r, i: 0.9 * step),
        "jitter 0-1.8 t (sleep, mean 0.9 t)": lambda: Loader(x, y, args.batch, Jitter(1.8 * step)),
        "jitter 0-1.8 t, a one-shot generator": lambda: OneShot(Loader(x, y, args.batch, Jitter(1.8 * step))),
        "CPU-heavy 0.5 t (Python, GIL held), in the thread": lambda: Loader(
            x, y, args.batch, lambda r, i: 0.5 * step, cpu=True
        ),
    }
    sources = {  # one pool per source, started before the clock
        f"CPU-heavy {share} t, {args.workers} worker process(es)": tk.sources.RandomAccessSource(
            DecodedRows(x, y, share * step / args.batch), workers=args.workers
        )
        for share in (0.5, 0.9)
    }
    started = time.perf_counter()
    for source in sources.values():
        run(trainer, source, PREFETCH, batch_size=args.batch)
    startup = (time.perf_counter() - started - 2 * args.steps * step) / 2
    rates: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        rates.setdefault(("compute-only (arrays)", PREFETCH), []).append(
            run(trainer, (x, y), PREFETCH, batch_size=args.batch)[0]
        )
        for name, make in cases.items():
            for prefetch in (PREFETCH, 0):
                rates.setdefault((name, prefetch), []).append(run(trainer, make(), prefetch)[0])
        for name, source in sources.items():
            rates.setdefault((name, PREFETCH), []).append(run(trainer, source, PREFETCH, batch_size=args.batch)[0])
    base = statistics.median(rates[("compute-only (arrays)", PREFETCH)])
    print(f"| loader | prefetch ({PREFETCH} batches, the default) | no prefetch (read one step ahead) |")
    print("|---|---|---|")
    for name in ["compute-only (arrays)", *cases, *sources]:
        on = statistics.median(rates[(name, PREFETCH)]) / base
        off = f"{statistics.median(rates[(name, 0)]) / base:.3f}" if (name, 0) in rates else ""
        print(f"| {name} | **{on:.3f}** | {off} |")
    print(f"worker pool start-up: {startup:.2f} s, once per source (outside the steady-state figures)")


if __name__ == "__main__":
    main()
