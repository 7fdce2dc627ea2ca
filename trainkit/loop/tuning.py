"""``steps_per_execution="auto"``: the smallest number of steps per compiled call that keeps
the host's share of a step small, from the first steps' own timings.

Each call costs the host about ``h`` seconds (reading and placing the batch, the hooks, the
dispatch) and the device ``d`` per step; ``k`` steps per call cost the host ``h / k`` per step.
The tuner times a few synchronous calls of one step and picks the smallest power of two ``k``
with ``h / k <= HOST_SHARE * d``, capped by the epoch, the periodic actions (validation,
checkpoints, loggers) and the callbacks that need a call per batch.

Left to its default (``Trainer(steps_per_execution=None)``), the tuner fuses only where the run
repays it: the host time ``k`` steps per call save over the rest of the fit must exceed
the fused program's compile: :data:`FUSED_COMPILE_FACTORS` (per platform) times the trainer's
longest first call of a fit with the one-step program's compile (its first call's, or on an
accelerator the memory check's before it) until a fused compile was measured on this trainer's
devices, then the measured ratio. A short fit stays at one step per call and
decides again next time. Once fused, the default checks its guess (:class:`FusedCheck`): a few
fused calls are timed, and where they are no faster a step than one step per call was, the
fit goes back to one step per call for good (the device's fused call may cost the host more
per step than its saved dispatch: a fused call never loses to k=1 by more than its checks).

>>> tuner = StepsTuner(cap=64)
>>> for _ in range(PROBES):
...     tuner.record(host=50e-6, device=40e-6)
>>> tuner.steps  # 50 / (0.05 * 40) = 25 -> 32
32
>>> StepsTuner(cap=64).decide(host=1e-6, device=1e-3)  # the step dominates: one per call
1
"""

from __future__ import annotations

import dataclasses
import math
import statistics

#: The host's share of the device time per step that "auto" aims under.
HOST_SHARE = 0.05
#: Synchronous one-step calls timed before deciding (after the first, which compiles).
PROBES = 6
#: The most steps per call "auto" picks (the compiled scan's batches are all on the device).
MOST = 128
#: Compiling the fused program (and placing its first stacked batches) over the one-step program's
#: first call, its compile included wherever it ran (on an accelerator the memory check compiles it
#: before that call: :meth:`~trainkit.program.compiled.CompiledFunctions.compiled_ahead_seconds`), per
#: platform, until a fused compile was measured on the trainer's own devices:
#:
#: - ``"cpu"``: 4.3x on the dispatch-bound MLP of ``benchmarks/step_overhead.py`` (2.3 s more for the
#:   first fit of ``"auto"`` than of k=1, against a 0.54 s first call), taken as 4;
#: - ``"tpu"``: one v5e, JAX 0.10.2 (2026-12-07, fresh fits, the compilation cache off): 1.79x on the
#:   dispatch MLP, taken as 1.8; on three models it was not fitted to 1.58x (an MLP 784-512-512-10 at
#:   batch 128), 2.15x (a two-convolution CNN) and 1.43x (a two-block LM): within 25% of it.
#:
#: Other platforms take the CPU's (not measured there).
FUSED_COMPILE_FACTORS = {"cpu": 4.0, "tpu": 1.8}


def prior_compile_factor(platform: str) -> float:
    """The fused compile over the one-step first call assumed on ``platform`` (:data:`FUSED_COMPILE_FACTORS`).

    >>> prior_compile_factor("tpu"), prior_compile_factor("gpu")
    (1.8, 4.0)
    """
    return FUSED_COMPILE_FACTORS.get(platform, FUSED_COMPILE_FACTORS["cpu"])


@dataclasses.dataclass
class Timings:
    """What the tuner measured in a trainer's earlier fits: its longest first call of a fit (the
    one-step program's compile) and the median host and device seconds of a one-step call
    (``None``: not measured yet). A later fit under the default setting decides from them
    without timing steps again.

    >>> timings = Timings()
    >>> timings.saw_first_call(0.4), timings.saw_first_call(0.01)
    (0.4, 0.4)
    """

    first_call: float = 0.0
    host: float | None = None
    device: float | None = None
    #: a fused program's compile over the first call, measured on these devices (``None``: not yet)
    compile_factor: float | None = None

    def saw_first_call(self, seconds: float) -> float:
        """Records a fit's first call; returns the longest so far."""
        self.first_call = max(self.first_call, seconds)
        return self.first_call

    def saw_steps(self, host: float, device: float) -> None:
        self.host, self.device = host, device

    def saw_fused_compile(self, seconds: float) -> None:
        """A fused program's first call took ``seconds``: its ratio to the longest first call, kept
        from the trainer's first fused program (a later fit's first call may find it compiled)."""
        if self.first_call > 0 and self.compile_factor is None:
            self.compile_factor = seconds / self.first_call


class StepsTuner:
    """Collects ``(host, device)`` seconds of one-step calls and decides ``steps``: ``None``
    until :data:`PROBES` calls were recorded. ``remaining``: the fit's steps still to run
    (``None``: unknown); with ``repaid_only`` (the default setting) a ``k`` the rest of the fit
    does not repay is 1 (:meth:`repays`).

    >>> tuner = StepsTuner(cap=64, remaining=100, repaid_only=True)
    >>> tuner.compile_seconds = 0.5  # the first call compiled for half a second
    >>> tuner.decide(host=50e-6, device=40e-6)  # 100 steps save 5 ms: not worth a 2 s compile
    1
    """

    def __init__(
        self,
        cap: int | None,
        remaining: int | None = None,
        repaid_only: bool = False,
        compile_factor: float | None = None,
    ):
        self.cap = max(1, min(MOST, cap if cap is not None else MOST))
        self.hosts: list[float] = []
        self.devices: list[float] = []
        self.steps: int | None = None if self.cap > 1 else 1
        self.remaining, self.repaid_only = remaining, repaid_only
        #: the trainer's longest first call of a fit, in seconds (the one-step program's compile)
        self.compile_seconds = 0.0
        #: the fused compile over that first call: measured on these devices, else the platform's prior
        self.compile_factor = prior_compile_factor("cpu") if compile_factor is None else compile_factor

    def first_call(self, seconds: float) -> None:
        """The trainer's longest first call of a fit (what a fused program's compile is weighed by)."""
        self.compile_seconds = seconds

    def record(self, host: float, device: float) -> None:
        self.hosts.append(host)
        self.devices.append(device)
        if len(self.hosts) >= PROBES and self.steps is None:
            self.steps = self.decide(statistics.median(self.hosts), statistics.median(self.devices))

    def decide_from(self, host: float, device: float) -> None:
        """Decides from an earlier fit's timings, without timing steps."""
        self.hosts, self.devices = [host], [device]
        self.steps = self.decide(host, device)

    def decide(self, host: float, device: float) -> int:
        """The smallest power of two ``k`` (at most the cap) with ``host / k <= HOST_SHARE * device``."""
        needed = host / max(HOST_SHARE * device, 1e-9)
        if needed <= 1:
            return 1
        steps = min(self.cap, 1 << math.ceil(math.log2(needed)))
        return steps if not self.repaid_only or self.repays(steps, host) else 1

    def repays(self, steps: int, host: float) -> bool:
        """Whether ``steps`` per call save more host time over the rest of the fit than
        compiling the fused program costs (``compile_factor`` first calls: :data:`FUSED_COMPILE_FACTORS`)."""
        if self.remaining is None:
            return False
        return self.remaining * host * (1 - 1 / steps) > self.compile_factor * self.compile_seconds


#: Fused calls timed (after the one that compiles) before the default keeps or drops fusing.
CHECKS = 3


class FusedCheck:
    """Whether ``steps`` per call, picked by the default setting, train faster a step than one
    step per call did (``single``: its seconds a step, the larger of its host and device time,
    which one step per call overlaps). :meth:`ready` takes the
    time each fused call's results were ready; the first call compiles (its seconds, from
    ``started``, are the fused compile), the next :data:`CHECKS` intervals are the fused
    steps' cost, reading and placing their batches included. ``verdict`` is ``None`` until
    then, then ``True`` (keep fusing) or ``False``.

    >>> check = FusedCheck(steps=32, single=100e-6, started=0.0)
    >>> for ready in (2.0, 2.004, 2.008, 2.012):  # 4 ms a call of 32: 125 us a step
    ...     check.ready(ready)
    >>> check.verdict, round(check.compile_seconds, 3)
    (False, 2.0)
    """

    def __init__(self, steps: int, single: float, started: float):
        self.steps, self.single = steps, single
        self.last: float = started
        self.compile_seconds: float | None = None
        self.intervals: list[float] = []
        self.verdict: bool | None = None

    def calling(self, when: float) -> None:
        """A fused call starts at ``when``: the first one's compile is timed from there."""
        if self.compile_seconds is None:
            self.last = when

    def ready(self, when: float) -> None:
        if self.compile_seconds is None:
            self.compile_seconds = when - self.last
        else:
            self.intervals.append(when - self.last)
        self.last = when
        if len(self.intervals) >= CHECKS:
            self.verdict = self.per_step() < self.single

    def per_step(self) -> float:
        """The fused calls' median seconds a step."""
        return statistics.median(self.intervals) / self.steps
