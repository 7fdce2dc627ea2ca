"""``steps_per_execution="auto"``: the smallest number of steps per compiled call that keeps
the host's share of a step small, from the first steps' own timings.

Each call costs the host about ``h`` seconds (reading and placing the batch, the hooks, the
dispatch) and the device ``d`` per step; ``k`` steps per call cost the host ``h / k`` per step.
The tuner times a few synchronous calls of one step and picks the smallest power of two ``k``
with ``h / k <= HOST_SHARE * d``, capped by the epoch, the periodic actions (validation,
checkpoints, loggers) and the callbacks that need a call per batch.

>>> tuner = StepsTuner(cap=64)
>>> for _ in range(PROBES):
...     tuner.record(host=50e-6, device=40e-6)
>>> tuner.steps  # 50 / (0.05 * 40) = 25 -> 32
32
>>> StepsTuner(cap=64).decide(host=1e-6, device=1e-3)  # the step dominates: one per call
1
"""

from __future__ import annotations

import math
import statistics

#: The host's share of the device time per step that "auto" aims under.
HOST_SHARE = 0.05
#: Synchronous one-step calls timed before deciding (after the first, which compiles).
PROBES = 6
#: The most steps per call "auto" picks (the compiled scan's batches are all on the device).
MOST = 128


class StepsTuner:
    """Collects ``(host, device)`` seconds of one-step calls and decides ``steps``: ``None``
    until :data:`PROBES` calls were recorded."""

    def __init__(self, cap: int | None):
        self.cap = max(1, min(MOST, cap if cap is not None else MOST))
        self.hosts: list[float] = []
        self.devices: list[float] = []
        self.steps: int | None = None if self.cap > 1 else 1

    def record(self, host: float, device: float) -> None:
        self.hosts.append(host)
        self.devices.append(device)
        if len(self.hosts) >= PROBES and self.steps is None:
            self.steps = self.decide(statistics.median(self.hosts), statistics.median(self.devices))

    def decide(self, host: float, device: float) -> int:
        """The smallest power of two ``k`` (at most the cap) with ``host / k <= HOST_SHARE * device``."""
        needed = host / max(HOST_SHARE * device, 1e-9)
        if needed <= 1:
            return 1
        return min(self.cap, 1 << math.ceil(math.log2(needed)))
