"""Side-by-side timing shared by the benchmarks: contenders run alternately, medians reported."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def measure_rounds(contenders: dict[str, Callable[[], None]], steps: int, repeats: int) -> dict[str, list[float]]:
    """Steps per second of each contender (``run()`` does ``steps`` steps) in each of
    ``repeats`` rounds: one warm-up run each (compiles), then rounds in which every contender
    runs once, in turn. Alternating spreads the machine's drift over all contenders alike."""
    for run in contenders.values():  # compile and warm up
        run()
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, run in contenders.items():  # alternate
            start = time.perf_counter()
            run()
            rates[name].append(steps / (time.perf_counter() - start))
    return rates


def measure(contenders: dict[str, Callable[[], None]], steps: int, repeats: int) -> dict[str, float]:
    """The median of each contender's :func:`measure_rounds`."""
    return {name: statistics.median(r) for name, r in measure_rounds(contenders, steps, repeats).items()}


def paired_ratio(rounds: dict[str, list[float]], name: str, base: str) -> float:
    """The median over rounds of ``name``'s rate over ``base``'s in the same round: on a machine
    whose speed drifts between rounds (other tenants), each ratio compares runs seconds apart."""
    return statistics.median(a / b for a, b in zip(rounds[name], rounds[base], strict=True))
