"""``Ledger``: where a ``fit``'s wall time went, in buckets that add up to the whole.

One clock, switched between buckets by whoever starts a different kind of work (the loop when
it waits for the data, the callback list around each callback, the validation): the time since
the last switch goes to the bucket that was running. JAX reports every trace, lowering and
backend compile as a time span (``jax.monitoring``); the part of an interval those spans cover
goes to ``"compile"`` instead, so compiles inside a validation or a first step are counted once,
as compiles. Nothing here touches a device: a switch reads the clock and adds a float.

Buckets: ``startup`` (the backend, ``jax.distributed``, the setup of ``fit`` before its first
step), ``compile``, ``input`` (the loop blocked on the data), ``step`` (dispatching and running
the training steps: the productive time), ``validation``, ``checkpoint`` (blocking checkpoint
time), ``callbacks/<Class>`` (host work in a callback's hooks) and ``lost`` (step time of a run
that was interrupted after its last checkpoint, recomputed after the resume).

>>> ledger = Ledger()
>>> with ledger.running():
...     previous = ledger.switch(Bucket.INPUT); _ = sum(range(10_000)); _ = ledger.switch(previous)
>>> result = ledger.result()
>>> sorted(result.buckets) == ["input", "startup"], abs(sum(result.buckets.values()) - result.wall_seconds) < 1e-9
(True, True)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax

#: JAX's events whose spans are compile time (tracing, lowering to MLIR, the backend's compile)
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_BACKEND_COMPILE = COMPILE_EVENTS[2]
_CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "hit", "/jax/compilation_cache/cache_misses": "miss"}
#: the completed calls the step-time median and p99 are taken over (the most recent)
RECENT_CALLS = 20_000


class Bucket(enum.StrEnum):
    """The ledger's fixed buckets, in the order they are shown (a callback's own,
    ``callbacks/<Class>``, follow them, then ``LOST``); each is its name as a string, so the
    results and the saved JSON read ``"step"``.

    >>> Bucket.STEP == "step", [str(b) for b in ORDER][:3]
    (True, ['startup', 'compile', 'input'])
    """

    STARTUP = "startup"  # the backend, jax.distributed, the setup of fit before its first step
    COMPILE = "compile"  # JAX's trace, lowering and backend-compile spans, wherever they fall
    INPUT = "input"  # the loop blocked on the data
    STEP = "step"  # dispatching and running the training steps: the productive time
    VALIDATION = "validation"
    CHECKPOINT = "checkpoint"  # blocking checkpoint time
    SKIPPED = "skipped"  # step time of the updates SpikeSkip threw away: run, not applied
    LOST = "lost"  # step time of an interrupted run after its last checkpoint, recomputed after the resume


#: the productive bucket: goodput = its seconds / the wall time
PRODUCTIVE = Bucket.STEP
#: the order the fixed buckets are shown in (callback buckets follow, then ``lost``)
ORDER = tuple(b for b in Bucket if b is not Bucket.LOST)


@dataclasses.dataclass
class CompileRecord:
    """One function's backend compiles in a ``fit``: seconds, and persistent-cache hits and
    misses (both 0 when no persistent cache is on)."""

    seconds: float = 0.0
    compiles: int = 0
    hits: int = 0
    misses: int = 0


class _Outcome(threading.local):
    """A thread's last persistent-cache outcome (``"hit"`` / ``"miss"``), read by its next compile."""

    value: str | None = None


class _CompileSpans:
    """What JAX's listeners report, from any thread: compile spans not yet given to an interval,
    per-function records, and each thread's last cache outcome (read by its next backend compile)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: list[tuple[float, float]] = []
        self.records: dict[str, CompileRecord] = {}
        self.outcome = _Outcome()
        self.listening = False

    def listen(self) -> None:
        if not self.listening:
            self.listening = True
            jax.monitoring.register_event_time_span_listener(self.on_span)
            jax.monitoring.register_event_listener(self.on_event)

    def on_event(self, event: str, **kwargs: str | int) -> None:
        if event in _CACHE_EVENTS:
            self.outcome.value = _CACHE_EVENTS[event]

    def on_span(self, event: str, start_time: float, end_time: float, **kwargs: str | int) -> None:
        if event not in COMPILE_EVENTS:
            return
        with self.lock:
            self.pending.append((start_time, end_time))
            if event == _BACKEND_COMPILE:
                record = self.records.setdefault(str(kwargs.get("fun_name", "?")), CompileRecord())
                record.seconds += end_time - start_time
                record.compiles += 1
                outcome = self.outcome.value
                record.hits += outcome == "hit"
                record.misses += outcome == "miss"
                self.outcome.value = None
            if len(self.pending) > 4096:  # no ledger is taking them (no fit runs): keep the newest
                del self.pending[:2048]

    def covered(self, start: float, end: float) -> float:
        """Seconds of ``[start, end]`` that compile spans cover (their union); the spans are consumed."""
        with self.lock:
            spans, self.pending = sorted(self.pending), []
        covered, reach = 0.0, start
        for span_start, span_end in spans:
            lo, hi = max(span_start, reach), min(span_end, end)
            if hi > lo:
                covered += hi - lo
                reach = hi
        return covered

    def copied_records(self) -> dict[str, CompileRecord]:
        """The per-function records so far (a copy; :meth:`clear` empties them)."""
        with self.lock:
            return {name: dataclasses.replace(record) for name, record in self.records.items()}

    def clear(self) -> None:
        """A new fit: the spans and records from before it are not its time."""
        with self.lock:
            self.pending, self.records = [], {}


_SPANS = _CompileSpans()


@dataclasses.dataclass(frozen=True)
class ProcessLedger:
    """One process's buckets and step-time spread (median, p99 seconds per step) in a
    multi-process ``fit``."""

    index: int
    buckets: dict[str, float]
    step_median: float | None
    step_p99: float | None


class Buckets(dict[str, float]):
    """Seconds by bucket; a bucket no second went to reads as a ``KeyError`` naming those that exist.

    >>> try:
    ...     Buckets({"step": 1.0})["compilation"]
    ... except KeyError as error:
    ...     print(str(error)[:60])
    "no bucket 'compilation': this fit's buckets are ['step'] (s
    """

    def __missing__(self, key: str) -> float:
        raise KeyError(
            f"no bucket {key!r}: this fit's buckets are {sorted(self)} (see trainkit.record.ledger; a bucket no time "
            "went to is absent, .get(name, 0.0) reads it as 0)"
        )


@dataclasses.dataclass
class Goodput:
    """Where a ``fit``'s wall time went (``history.goodput``; see :class:`Ledger`): ``buckets``
    maps each bucket to seconds, which add up to ``wall_seconds``; ``goodput`` is the step time
    over the wall time. Carried across resumes: a run resumed by ``BackupAndRestore`` counts the
    interrupted runs' time too (``restarts``), and the steps they ran after their last backup as
    ``lost_steps`` (their time in the ``lost`` bucket). ``compiles``: each compiled function's
    seconds and cache hits and misses (this ``fit``'s). ``processes``: each process's buckets
    (several processes), and ``stragglers`` the process that spent the most in each bucket.
    Taken as ``on_train_end`` begins (its hooks print and log it) and brought up to the end of
    ``fit`` after them (:meth:`Ledger.amend`)."""

    buckets: dict[str, float]
    wall_seconds: float
    lost_steps: int = 0
    restarts: int = 0
    compiles: dict[str, CompileRecord] = dataclasses.field(default_factory=dict)
    step_median: float | None = None
    step_p99: float | None = None
    processes: tuple[ProcessLedger, ...] = ()
    stragglers: dict[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.buckets = Buckets(self.buckets)

    @property
    def goodput(self) -> float:
        return self.buckets.get(PRODUCTIVE, 0.0) / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def top_loss(self) -> tuple[str, float] | None:
        """The bucket other than ``step`` that took the most time, and its share of the wall."""
        losses = [(seconds, name) for name, seconds in self.buckets.items() if name != PRODUCTIVE]
        if not losses or self.wall_seconds <= 0:
            return None
        seconds, name = max(losses)
        return name, seconds / self.wall_seconds

    def scalars(self) -> dict[str, float]:
        """What the loggers write: ``goodput`` and ``goodput/<bucket>`` seconds."""
        return {"goodput": self.goodput, "goodput/wall": self.wall_seconds} | {
            f"goodput/{name}": seconds for name, seconds in self.buckets.items()
        }


def ordered(buckets: dict[str, float]) -> list[str]:
    """Bucket names in the order they are shown: the fixed ones, the callbacks', then ``lost``."""
    fixed = [str(name) for name in ORDER if name in buckets]
    rest = sorted(name for name in buckets if name not in ORDER and name != Bucket.LOST)
    return fixed + rest + ([str(Bucket.LOST)] if Bucket.LOST in buckets else [])


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, max(0, round(q * (len(ranked) - 1))))]


class Ledger:
    """The clock of a running ``fit`` (the session holds one; see the module docstring).
    Outside :meth:`running` a switch changes nothing but the bucket name it returns."""

    def __init__(self) -> None:
        self.active = False
        self.current: str = Bucket.STARTUP
        self.since = 0.0
        self.seconds: dict[str, float] = {}
        #: (perf_counter stamp, steps) of the last ``RECENT_CALLS`` completed calls (the step-time spread)
        self.completed: collections.deque[tuple[float, int]] = collections.deque(maxlen=RECENT_CALLS)
        self.carried: dict[str, Any] = {}  # the interrupted runs' ledger (:meth:`carry`)
        self.started = self.prior = 0.0
        self.last: Goodput | None = None  # the result of the last fit (:meth:`close`)

    @contextlib.contextmanager
    def running(self, startup: dict[str, float] | None = None) -> Iterator[Ledger]:
        """Counts from now until the block ends (the ledger of one ``fit``). ``startup``: seconds
        this process spent starting before it (``jax.distributed``, the backend), counted once."""
        _SPANS.listen()
        _SPANS.clear()
        self.prior = sum((startup or {}).values())  # counted before this fit's clock started
        self.seconds, self.carried, self.last = {str(Bucket.STARTUP): self.prior}, {}, None
        self.completed.clear()
        self.active, self.current, self.since = True, str(Bucket.STARTUP), time.time()
        self.started = self.since
        try:
            yield self
        finally:
            self.settle()
            self.active = False

    def switch(self, bucket: Bucket | str) -> str:
        """From now the time goes to ``bucket`` (a :class:`Bucket`, or a callback's
        ``callbacks/<Class>``); returns the bucket that was running (switch back to it when the
        work ends)."""
        previous = self.current
        if self.active:
            now = time.time()  # JAX's spans are time.time()
            compiled = _SPANS.covered(self.since, now) if _SPANS.pending else 0.0
            seconds = self.seconds
            seconds[previous] = seconds.get(previous, 0.0) + (now - self.since - compiled)
            if compiled:
                seconds[str(Bucket.COMPILE)] = seconds.get(Bucket.COMPILE, 0.0) + compiled
            self.since = now
        self.current = str(bucket)  # a plain string: the results' keys read as names
        return previous

    @contextlib.contextmanager
    def bucket(self, name: Bucket | str) -> Iterator[None]:
        """The block's time goes to ``name``, then back to the bucket that ran before."""
        previous = self.switch(name)
        try:
            yield
        finally:
            self.switch(previous)

    def settle(self) -> None:
        """Everything up to now counted (the running bucket stays)."""
        self.switch(self.current)

    def reassign(self, steps: int, to: Bucket | str) -> None:
        """The step time of ``steps`` steps (the median recent step's, else the mean) counted under
        ``to`` instead of :data:`PRODUCTIVE`: steps that ran but whose work was thrown away (the
        updates ``SpikeSkip`` skipped)."""
        self.settle()
        productive = self.seconds.get(PRODUCTIVE, 0.0)
        recent = self.step_times()
        each = statistics.median(recent) if recent else 0.0
        moved = min(productive, steps * each)
        if moved > 0:
            self.seconds[PRODUCTIVE] = productive - moved
            self.seconds[str(to)] = self.seconds.get(str(to), 0.0) + moved

    def step_completed(self, stamp: float, steps: int = 1) -> None:
        """A call of ``steps`` steps finished at ``stamp`` (``time.perf_counter()``); ``steps=0``
        marks an epoch's start (no step time spans an epoch's end and the next one's start)."""
        self.completed.append((stamp, steps))

    def step_times(self) -> list[float]:
        """Seconds per step between consecutive completed calls of one epoch (a fused call's
        steps share its time), over the last ``RECENT_CALLS`` calls."""
        pairs = list(self.completed)
        times: list[float] = []
        for (before, _), (stamp, steps) in zip(pairs, pairs[1:]):
            if steps and before:
                times.extend([(stamp - before) / steps] * steps)
        return times

    def carry(self, interrupted: dict[str, Any]) -> None:
        """The ledger of the runs before a resume (:meth:`saved`, with ``lost_steps`` and the
        ``lost`` bucket filled in by whoever resumed): this run's result includes them."""
        self.carried = interrupted

    def saved(self, settle: bool = True) -> dict[str, Any]:
        """This run's ledger so far, with the carried one, as JSON (for a manifest or journal);
        ``settle=False``: up to the last switch."""
        if settle:
            self.settle()
        carried = self.carried.get("buckets", {})
        buckets = {name: carried.get(name, 0.0) + self.seconds.get(name, 0.0) for name in {*carried, *self.seconds}}
        wall = self.carried.get("wall_seconds", 0.0) + self.prior + (self.since - self.started)
        return {
            "buckets": buckets,
            "wall_seconds": wall,
            "lost_steps": int(self.carried.get("lost_steps", 0)),
            "restarts": int(self.carried.get("restarts", 0)),
        }

    def result(self, processes: tuple[ProcessLedger, ...] = (), settle: bool = True) -> Goodput:
        """The ledger as a :class:`Goodput` (``processes``: every process's, when several ran;
        ``settle=False``: up to the last switch)."""
        saved = self.saved(settle)
        buckets = {name: saved["buckets"][name] for name in ordered(saved["buckets"])}
        times = self.step_times()
        stragglers = {}
        if processes:
            for name in buckets:
                stragglers[name] = max(processes, key=lambda p: p.buckets.get(name, 0.0)).index
        return Goodput(
            buckets=buckets,
            wall_seconds=saved["wall_seconds"],
            lost_steps=saved["lost_steps"],
            restarts=saved["restarts"],
            compiles=_SPANS.copied_records(),
            step_median=percentile(times, 0.5) if times else None,
            step_p99=percentile(times, 0.99) if times else None,
            processes=processes,
            stragglers=stragglers,
        )

    def amend(self) -> None:
        """The last result brought up to now, in place (``history.goodput`` is that object):
        the time of the hooks that ran after it was taken (``on_train_end``'s) counted too."""
        if self.last is not None:
            self.settle()
            vars(self.last).update(vars(self.result(self.last.processes, settle=False)))

    def close(self, processes: tuple[ProcessLedger, ...] = ()) -> Goodput | None:
        """The fit's result, kept as :attr:`last` (up to the last switch: call :meth:`settle`
        before gathering ``processes``); ``None`` when no ledger runs (a loop driven directly)."""
        self.last = self.result(processes, settle=False) if self.active else None
        return self.last
