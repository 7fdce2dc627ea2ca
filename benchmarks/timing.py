"""Side-by-side timing shared by the benchmarks: contenders run alternately, medians reported."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def measure(contenders: dict[str, Callable[[], None]], steps: int, repeats: int) -> dict[str, float]:
    """Steps per second of each contender (``run()`` does ``steps`` steps): one warm-up run
    each (compiles), then ``repeats`` rounds in which every contender runs once, in turn; the
    median of each. Alternating spreads the machine's drift over all contenders alike."""
    for run in contenders.values():  # compile and warm up
        run()
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, run in contenders.items():  # alternate
            start = time.perf_counter()
            run()
            rates[name].append(steps / (time.perf_counter() - start))
    return {name: statistics.median(r) for name, r in rates.items()}
