"""Whether comparing more strategies can pay for itself within one run.

``strategy="auto"`` compiles and times the simplest candidate first (the one it would fall back
to). Each other candidate costs about one more compile and a few timed steps; over the run it
can save at most its step-time gain on every step. A candidate whose best case cannot repay its
cost within the run's steps is not compiled: a 1-step smoke test or a 2-minute CPU run starts at
once, a long run on several accelerators still compares everything.

The best case bounds how much faster another candidate could be than the measured one:
accelerators add compute with each device, so a candidate over ``n`` devices is at most ``n``
times faster; CPU devices (``--xla_force_host_platform_device_count``) are one host's cores, so
a split can at most use the cores the measured step left idle (its process CPU seconds per
wall second say how many it used).

>>> bound = speedup_bound(devices=8, platform="cpu", busy_cores=1.6, cores=2)
>>> round(bound, 2), speedup_bound(devices=8, platform="gpu", busy_cores=1.0, cores=2)
(1.25, 8.0)
>>> worth = Worth.of(step_seconds=0.06, bound=1.25, cost_seconds=2.5)
>>> worth.break_even_steps, worth.pays(steps=1), worth.pays(steps=1000)
(209, False, True)
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import NamedTuple


class Timing(NamedTuple):
    """A candidate's timed steps: the fastest step's seconds, and the host's CPU seconds per
    wall second while they ran (how many cores the step kept busy)."""

    seconds: float
    busy_cores: float


def host_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on every platform
        return os.cpu_count() or 1


def speedup_bound(*, devices: int, platform: str, busy_cores: float, cores: int) -> float:
    """At most how many times faster than a measured step another candidate over ``devices``
    devices could run (see the module docstring); at least 1."""
    if platform == "cpu":
        return max(1.0, min(float(devices), cores / max(1.0, busy_cores)))
    return max(1.0, float(devices))


@dataclasses.dataclass(frozen=True)
class Worth:
    """What comparing one more candidate could save per step, what it costs, and from how many
    run steps on it pays (``math.inf``: never)."""

    saving_per_step: float
    cost_seconds: float
    bound: float

    @classmethod
    def of(cls, *, step_seconds: float, bound: float, cost_seconds: float) -> Worth:
        return cls(step_seconds * (1.0 - 1.0 / bound), cost_seconds, bound)

    @property
    def break_even_steps(self) -> float:
        if self.saving_per_step <= 0:
            return math.inf
        return math.ceil(self.cost_seconds / self.saving_per_step)

    def pays(self, steps: int | None) -> bool:
        """Whether a run of ``steps`` steps (``None``: unknown, so it may be long) repays it."""
        return steps is None or steps >= self.break_even_steps

    def why_not(self, steps: int) -> str:
        """The reason a candidate was not compiled, for the plan's row."""
        return (
            f"not compiled: at most {self.bound:.3g}x faster, it could save {self.saving_per_step * steps:.2g} s "
            f"over this run's {steps} steps, less than the ~{self.cost_seconds:.2g} s that compiling and timing "
            "it costs (strategy=tk.strategies.Auto(always_compare=True) compares anyway)"
        )
