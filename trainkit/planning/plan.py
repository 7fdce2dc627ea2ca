"""A compiler-measured memory and cost plan: the real train step compiled under each strategy.

For every candidate strategy the train step is lowered with an abstract state (nothing is
allocated) and compiled; ``compiled.memory_analysis()`` gives the per-device argument, output,
temporary and total bytes, ``compiled.cost_analysis()`` the flops and bytes accessed, and the
compiled HLO the collectives and the bytes they move. A roofline-style model turns these into
an estimated step time; ``measure=True`` times a few real steps instead. ``strategy="auto"``
picks the fastest strategy whose total fits the device memory with headroom.

>>> hlo = "%all-gather.1 = f32[256,128]{1,0} all-gather(%p), dimensions={0}"
>>> collective_traffic(hlo)
(131072, {'all-gather': 1})
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from rich.console import Console
from rich.table import Table

from trainkit import distributed
from trainkit.attn import AttentionCall, attention_calls
from trainkit.attn.causal_balance import tiles_per_device
from trainkit.core import checks, chips
from trainkit.core import cost as cost_lib
from trainkit.core.leaf_step import LeafStep
from trainkit.core.offload import in_host_memory
from trainkit.core.state import Batch, TrainState
from trainkit.core.tree import PyTree, TreeFunction, array_bytes
from trainkit.data import check_batch_size
from trainkit.planning import budget as budget_lib
from trainkit.planning import compile_estimate, compiler_cycles
from trainkit.planning import targets as targets_lib
from trainkit.planning.dcn import dcn_traffic
from trainkit.strategies import FSDP, DataParallel, Hybrid, SingleDevice, Strategy
from trainkit.strategies.pipeline import bubble_fraction

logger = logging.getLogger("trainkit")

#: Timed steps per candidate when measuring (after one warm-up step); the fastest counts.
MEASURE_STEPS = 3

#: Fraction of the device memory a plan may use: the rest is headroom for the runtime,
#: fragmentation and the arrays the host keeps (prefetched batches, metrics).
HEADROOM = 0.9
#: The same where the compiler accounts for the whole program (a TPU: its compiler refuses a program
#: above the memory, and the program's peak is what runs); the 5% kept is for what the loop holds
#: beside the step (the batches read ahead, the metrics). On a v5e the 12 x 1,024 LM at batch 64
#: needs 14.74 of 15.75 GiB (93.6%) and runs; 0.9 answered 32 (issue #80).
EXACT_HEADROOM = 0.95


def usable_share(platform: str) -> float:
    """The share of a device's memory a plan and ``find_batch_size`` let a step use on ``platform``.

    >>> usable_share("tpu"), usable_share("gpu"), usable_share("cpu")
    (0.95, 0.9, 0.9)
    """
    return EXACT_HEADROOM if platform == "tpu" else HEADROOM


#: How much faster a more complex candidate must be for "auto" to pick it over a simpler one.
CLEAR_MARGIN = 0.15

_COLLECTIVE = re.compile(
    rf"=\s*(?P<type>\S.*?)\s+(?P<op>{compiler_cycles.COLLECTIVE_OPS})"
    r"(?P<start>-start)?\("
)
_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|f16|bf16|s32|u32|f32|s64|u64|f64|c64|c128)\[([\d,]*)\]")
_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}


class NotACandidate(ValueError):
    """Raised for a candidate that would train on other numbers than ``SingleDevice`` (it is
    left out before compiling; its row says why, and so does the pick's reason)."""

    def __init__(self, reason: str):
        super().__init__(f"not a candidate: {reason}")


def collective_traffic(hlo_text: str) -> tuple[int, dict[str, int]]:
    """Bytes produced by the collectives of a compiled HLO module, and how many of each kind."""
    total, counts = 0, dict[str, int]()
    for match in _COLLECTIVE.finditer(hlo_text):
        sizes = [
            _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
            for dtype, dims in _SHAPE.findall(match["type"])
        ]
        # an async "-start" returns (operands, results): count its largest buffer once
        total += max(sizes, default=0) if match["start"] else sum(sizes)
        counts[match["op"]] = counts.get(match["op"], 0) + 1
    return total, counts


#: the per-device memory (bytes, or text such as ``"16GiB"``) every plan, ``find_batch_size`` and
#: ``fit``'s first step are checked against, on any device: a chip's memory rehearsed on a CPU
MEMORY_VARIABLE = "TRAINKIT_DEVICE_MEMORY"


def device_memory_limit(devices: Sequence[jax.Device]) -> int:
    """Bytes one device may use: ``TRAINKIT_DEVICE_MEMORY`` where it is set, else the
    accelerator's limit, or on CPU the host memory shared by the host's devices."""
    if os.environ.get(MEMORY_VARIABLE):
        return int(checks.byte_count(os.environ[MEMORY_VARIABLE], MEMORY_VARIABLE) or 0)
    stats = None
    try:
        stats = devices[0].memory_stats()
    except Exception:  # noqa: BLE001 - not every backend implements it
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(host // max(1, len(jax.local_devices())))


def estimate_seconds(
    flops: float,
    bytes_accessed: float,
    collective_bytes: float,
    devices: Sequence[jax.Device],
    cycles: int | None = None,
) -> float:
    """One step's compute time plus its collectives' bytes over the links. The compute: on a chip
    whose rate of retiring its compiler's estimated ``cycles`` was measured (``Roofline.cycle_rate``,
    a TPU), those cycles at that rate; else a roofline, compute or memory time (on a known chip, over
    the share of it a real step was measured to reach: ``Roofline.reached``). Fake CPU devices share
    the host's cores, so their work adds up once they outnumber the cores."""
    platform, chip = devices[0].platform, targets_lib.chip_of(devices[0])
    flop_rate, memory_rate, link_rate = chips.UNKNOWN_RATES.get(platform, chips.UNKNOWN_RATES["gpu"])
    reached = 1.0
    if chip is not None and chip.roofline is not None:  # a known accelerator (or a target's): its public figures
        roofline = chip.roofline
        flop_rate, memory_rate, link_rate, reached = chip.flops, roofline.bandwidth, roofline.link, roofline.reached
        if cycles and roofline.cycle_rate:
            return cycles / roofline.cycle_rate + collective_bytes / link_rate
    seconds = max(flops / flop_rate, bytes_accessed / memory_rate) / reached + collective_bytes / link_rate
    if platform == "cpu":  # all devices' work shares the host's cores
        seconds *= len(devices) / (os.cpu_count() or 1)
    return seconds


def trust(row: PlanRow, measured: bool) -> str:
    """How far an estimated step time holds, where the chip says: `` (from the compiler's cycles:
    0.82-1.0x of the real step where checked)``; nothing for a measured or a roofline estimate."""
    chip = targets_lib.chip_of(row.strategy.devices[0])
    if measured or not row.cycles or chip is None or chip.roofline is None or not chip.roofline.cycle_rate:
        return ""
    low, high = chip.roofline.cycle_spread
    return f" (from the compiler's cycles: {low:.2f}-{high:.2f}x of the real step where checked on a {chip.name})"


def short_name(strategy: Strategy) -> str:
    """``FSDP(fsdp=8)``, ``Hybrid(data=2, fsdp=4)``, ``SingleDevice``: a table label, with the
    memory measures it carries (``FSDP(fsdp=8) + remat + offload``)."""
    return (
        _mesh_name(strategy)
        + (" + remat" if strategy.remat is not None else "")
        + (" + offload" if strategy.offload else "")
    )


def _mesh_name(strategy: Strategy) -> str:
    name = type(strategy).__name__
    try:
        mesh = strategy.mesh
    except Exception:  # noqa: BLE001 - a custom strategy without a mesh yet
        return name
    if mesh.size == 1:
        return name
    return f"{name}({', '.join(f'{k}={v}' for k, v in mesh.shape.items())})"


@dataclasses.dataclass
class PlanRow:
    """One strategy's compiled train step: per-device bytes, cost, and the verdict."""

    strategy: Strategy
    name: str
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    peak_bytes: int = 0  # the compiler's own device peak (TPU and GPU; on CPU it is the arguments)
    host_bytes: int = 0  # what the step keeps in host memory (offload): arguments, outputs, temporaries
    flops: float = 0.0
    bytes_accessed: float = 0.0
    collective_bytes: int = 0
    dcn_bytes: int = 0  # of those, what crosses slices (multi-slice TPU targets): the slow network
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)
    cycles: int | None = None  # a TPU compiler's estimated cycles of one step (planning.compiler_cycles)
    estimated_seconds: float = math.inf
    measured_seconds: float | None = None
    fits: bool = False
    recommended: bool = False
    error: str | None = None
    left_out: bool = False  # NotACandidate: it would compute another result
    skipped: str | None = None  # not compiled: it could not repay its compile within the run (budget)
    compile_seconds: float = 0.0  # lowering and compiling it, in wall seconds
    program_ops: int = 0  # the lowered program's operations (StableHLO), counted before it compiles
    timing: budget_lib.Timing | None = None
    attention: list[AttentionCall] = dataclasses.field(default_factory=list)  # reached under a context axis
    compiled: jax.stages.Compiled | None = dataclasses.field(default=None, repr=False)
    function: TreeFunction | None = dataclasses.field(default=None, repr=False)  # the step that was lowered

    @property
    def total_bytes(self) -> int:
        """Peak per-device bytes of the step: inputs, outputs not aliased to donated inputs,
        and temporaries, or the compiler's peak where it is larger (a TPU reports temporaries
        inside its peak)."""
        return max(self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes, self.peak_bytes)

    @property
    def seconds(self) -> float:
        return self.measured_seconds if self.measured_seconds is not None else self.estimated_seconds

    @property
    def bubble(self) -> float | None:
        """The fraction of a step each pipeline stage waits (GPipe's ``(S-1)/(M+S-1)``; ``None``:
        no pipeline)."""
        axis = self.strategy.stage_axis
        if axis is None:
            return None
        return bubble_fraction(stages=self.strategy.mesh.shape[axis], microbatches=self.strategy.microbatches)

    def layout_notes(self) -> list[str]:
        """What its pipeline or context axis does, in words (empty: neither)."""
        notes = []
        if self.bubble is not None:
            stages = self.strategy.mesh.shape[self.strategy.stage_axis]
            notes.append(
                f"{self.name}: a pipeline of {stages} stages x {self.strategy.microbatches} microbatches; each stage "
                f"holds 1/{stages} of the stacked blocks ({len(self.strategy.stage_paths)} parameters) and waits "
                f"{self.bubble:.1%} of a step (GPipe's bubble, (S-1)/(M+S-1))"
            )
        context = self.strategy.context_axis
        if context is not None:
            notes.append(
                f"{self.name}: each sequence (batch axis {self.strategy.sequence_axis}) split over "
                f"{self.strategy.mesh.shape[context]} devices, its activations with it; {self._attention_note()}"
            )
        return notes

    def _attention_note(self) -> str:
        split = [call for call in self.attention if call.split]
        whole = {f"{call.door}: {call.reason}" for call in self.attention if not call.split}
        if not split:
            said = f" ({'; '.join(sorted(whole))})" if whole else ""
            return (
                f"the context axis did not split the model's attention{said}: the compiler gathers what it needs "
                "from the layout. Write it with tk.attention (or, for nn.MultiHeadDotProductAttention and "
                "jax.nn.dot_product_attention, pass Hybrid(..., reach_attention=True)) to have keys and values "
                "all-gathered by hand"
            )
        doors = sorted({call.door for call in split})
        note = f"{len(split)} attention call(s) split by hand ({', '.join(doors)}: keys and values all-gathered)"
        balanced = sum(call.balanced for call in split)
        if balanced:
            tiles, block = tiles_per_device(self.strategy.mesh.shape[self.strategy.context_axis])
            note += f", {balanced} causal one(s) balanced ({tiles} of {block} score tiles per device)"
        return note + (f"; left to the compiler: {'; '.join(sorted(whole))}" if whole else "")

    @property
    def too_big(self) -> bool:
        """It runs this model, but not within the memory limit: compiled above it, refused by the
        target compiler for its memory, or its state alone above it (a measure may make it fit)."""
        if self.fits or self.left_out or self.skipped is not None:
            return False
        return self.error is None or any(sign in self.error for sign in MEMORY_ERRORS)


def analyse(row: PlanRow, compiled) -> PlanRow:
    """Fills ``row`` from a ``jax.stages.Compiled``."""
    memory = compiled.memory_analysis()
    if memory is not None:
        row.argument_bytes = int(memory.argument_size_in_bytes)
        row.output_bytes = int(memory.output_size_in_bytes)
        row.alias_bytes = int(memory.alias_size_in_bytes)
        row.temp_bytes = int(memory.temp_size_in_bytes)
        host = memory.host_argument_size_in_bytes + memory.host_output_size_in_bytes - memory.host_alias_size_in_bytes
        row.host_bytes = int(host + memory.host_temp_size_in_bytes)
        row.peak_bytes = int(memory.peak_memory_in_bytes) - row.host_bytes  # libtpu's peak counts host memory too
    cost = cost_lib.cost_of(compiled)
    row.flops = float(cost.get("flops", 0.0))
    row.bytes_accessed = float(cost.get("bytes accessed", 0.0))
    text = compiled.as_text()
    row.collective_bytes, row.collectives = collective_traffic(text)
    row.dcn_bytes = dcn_traffic(text)
    row.cycles = compiler_cycles.executed_cycles(text)
    row.estimated_seconds = estimate_seconds(
        row.flops, row.bytes_accessed, row.collective_bytes, row.strategy.devices, row.cycles
    )
    row.compiled = compiled
    return row


@dataclasses.dataclass(frozen=True, repr=False)
class MemoryPlan:
    """The rows of :func:`make_plan`; ``recommended`` is the strategy ``"auto"`` picks.
    ``initial_state``: the host copy of the state at step 0 when measuring built one (the
    trainer starts from it instead of initialising again), ``initialised_under``: the
    candidate whose compiled initialisation built it (a later run that remembers the pick
    initialises the same way, from the compilation cache)."""

    rows: list[PlanRow]
    memory_limit: int
    measured: bool
    initial_state: TrainState | None = None
    initialised_under: Strategy | None = None
    #: what was decided later on this plan's strategy (``steps_per_execution="auto"``'s pick), printed under it
    decided: dict[str, str] = dataclasses.field(default_factory=dict)
    #: candidates were left uncompiled as too costly for the run: from how many run steps on they would pay
    compare_from_steps: float | None = None
    #: the state's bytes by part before sharding (trainable and frozen params, optimizer state, model state)
    state_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    #: the devices planned for when they are not these (``"tpu v5e:4x4"``): compiled, not run
    target: str | None = None
    #: what was added to make a candidate fit when none did (``"remat"``, ``"offload"``, ...)
    added: str | None = None

    @property
    def recommended(self) -> PlanRow | None:
        return next((r for r in self.rows if r.recommended), None)

    def reason(self) -> str:
        best = self.recommended
        if best is None:
            return "no strategy fits: " + "; ".join(f"{r.name}: {r.error or gib(r.total_bytes)}" for r in self.rows)
        fitting = [r for r in self.rows if r.fits and r is not best]
        kind = "measured" if self.measured else "estimated"
        runner_up = min(fitting, key=lambda r: r.seconds, default=None)
        versus = (
            ""
            if runner_up is None
            else (f"; next {runner_up.name} at {runner_up.seconds / best.seconds:.2f}x its step time")
        )
        if runner_up is not None and runner_up.seconds < best.seconds:
            versus += f" (within the {CLEAR_MARGIN:.0%} margin: the simpler strategy is kept)"
        left_out = "".join(f"; {r.name} {r.error}" for r in self.rows if r.left_out)
        skipped: dict[str, list[str]] = {}
        for r in self.rows:
            if r.skipped is not None:
                skipped.setdefault(r.skipped, []).append(r.name)
        not_compiled = "".join(f"; {', '.join(names)} {why}" for why, names in skipped.items())
        added = "" if self.added is None else f" (added {self.added}: no candidate fit without it)"
        return (
            f"picked {best.name}{added}: {kind} {best.seconds * 1e3:.3g} ms/step{trust(best, self.measured)}, "
            f"{gib(best.total_bytes)} "
            f"of {gib(self.memory_limit)} per device{versus}{left_out}{not_compiled}"
        )

    def table(self) -> Table:
        """Per device: argument, temporary and total MiB (and, under offload, host MiB), GFLOP,
        MiB moved by collectives, and the estimated or measured milliseconds of one step; the
        pick of ``"auto"`` marked."""
        kind = "measured" if self.measured else "estimated"
        where = "" if self.target is None else f" for {self.target} (compiled here, not run)"
        title = (
            f"trainkit plan{where}: MiB per device of {self.memory_limit / 2**20:,.0f}; {kind} ms/step; <- auto's pick"
        )
        hosts = any(r.host_bytes for r in self.rows)  # offload: what stays in host memory, its own column
        dcn = any(r.dcn_bytes for r in self.rows)  # several slices: what crosses the data-center network
        columns = ("args", "temp", "total") + (("host",) if hosts else ()) + ("GFLOP", "comm")
        columns += ("dcn",) if dcn else ()
        columns += ("ms",)
        columns += ("compile s",) if self.target else ()
        blank = [""] * len(columns)
        rows: list[tuple[str, list[str], str]] = []
        for r in self.rows:
            if r.error:  # the reason is printed in full under the table: a long one would squeeze the figures
                rows.append((r.name, blank, "[red]see below[/red]"))
            elif r.skipped:
                why = "first_fit" if r.skipped.startswith(FIRST_FIT_SKIP) else "the run is too short to repay it"
                rows.append((r.name, blank, f"[dim]not compiled: {why}[/dim]"))
            else:
                verdict = "[bold green]<-[/bold green]" if r.recommended else ("" if r.fits else "[red]too big[/red]")
                cells = [_mib(r.argument_bytes), _mib(r.temp_bytes), _mib(r.total_bytes)]
                cells += [_mib(r.host_bytes)] if hosts else []
                cells += [_short(r.flops / 1e9)]
                cells += [_mib(r.collective_bytes)] + ([_mib(r.dcn_bytes)] if dcn else [])
                cells += [_short(r.seconds * 1e3)]
                cells += [f"{r.compile_seconds:.1f}"] if self.target else []
                rows.append((r.name, cells, verdict))
        table = Table(title=title)
        table.add_column("strategy", overflow="fold")  # wraps before a figure is cut: the figures keep their width
        for index, column in enumerate(columns):
            width = max([len(column), *(len(cells[index]) for _, cells, _ in rows)])
            table.add_column(column, justify="right", no_wrap=True, min_width=width)
        table.add_column("")
        for name, cells, verdict in rows:
            table.add_row(name, *cells, verdict)
        return table

    def print(self, console: Console | None = None) -> None:
        (console or Console()).print(self.table())
        for r in self.rows:  # each reason whole, wrapped to the console's width
            if r.error:
                (console or Console()).print(f"{r.name}: {r.error}", highlight=False, markup=False)
        for r in self.rows:
            for note in r.layout_notes():
                (console or Console()).print(note, highlight=False, markup=False)
        (console or Console()).print(self.reason())
        if self.state_bytes:
            parts = ", ".join(f"{name} {_mib(size)} MiB" for name, size in self.state_bytes.items())
            (console or Console()).print(f"state before sharding: {parts}", highlight=False)
        for name, decision in self.decided.items():
            (console or Console()).print(f"{name}: {decision}", highlight=False)

    def __str__(self) -> str:
        console = Console(width=120, record=True, file=open(os.devnull, "w"))
        self.print(console)
        return console.export_text()

    def __repr__(self) -> str:
        best = self.recommended
        return f"MemoryPlan({[r.name for r in self.rows]}, recommended={None if best is None else best.name})"


def _mib(n: float) -> str:
    return _short(n / 2**20)


def _short(value: float) -> str:
    """About three significant digits, without an exponent: 0.0152, 3.56, 35.6, 1,697."""
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if value >= 0.001 or value == 0 else "<0.001"


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.3g} MiB"


def default_candidates(devices: Sequence[jax.Device] | None = None) -> list[Strategy]:
    """SingleDevice (on one process), DataParallel and FSDP over ``devices`` (by default all
    devices of all processes), and on several processes the ``Hybrid`` that keeps FSDP inside a
    process and data parallelism across them (``data=processes``, ``fsdp=`` each one's devices).

    Other ``Hybrid`` shapes are not default candidates: on one host every device pair shares one
    interconnect, so a data x fsdp split lies between DataParallel and FSDP in both memory and
    traffic, and it was never the fastest of the five in ``docs/performance.md``'s plans (a 27.4M
    transformer and an MLP); each candidate is a compile that every cold ``"auto"`` pays. Pass
    ``Auto(candidates=[...])`` (or ``plan(candidates=[...])``) to weigh them too.
    """
    devices = list(devices if devices is not None else jax.devices())
    n, processes = len(devices), jax.process_count()
    # one process's single device cannot train a batch that other processes feed
    candidates: list[Strategy] = [SingleDevice(devices[0])] if processes == 1 else []
    if n > 1:
        candidates += [DataParallel(devices), FSDP(devices)]
    if processes > 1 and n % processes == 0 and n // processes > 1:
        candidates.append(Hybrid(data=processes, fsdp=n // processes, devices=devices))
    if processes > 1 and n % processes == 0:  # a pipeline across the hosts (never inside one: it loses there)
        candidates.append(Hybrid(stage=processes, fsdp=n // processes, devices=devices))
    return candidates


def context_candidate(rows: int, sequence: int | None, devices: Sequence[jax.Device] | None = None) -> Strategy | None:
    """When a batch has fewer rows than there are devices, so that no data-sharded strategy can
    split it (one sequence per device is what does not fit), a ``Hybrid`` with a context axis:
    the rows over ``data`` (as many as divide both), each sequence over the other devices; ``None``
    when the rows fill the devices, or no sequence (``sequence``: its length) splits that way.

    >>> short_name(context_candidate(2, 512, jax.devices()[:8]))
    'Hybrid(data=2, context=4)'
    >>> context_candidate(8, 512, jax.devices()[:8]) is None  # FSDP splits eight rows
    True
    """
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    if rows >= n or sequence is None:
        return None
    data = math.gcd(rows, n)
    context = n // data
    if context < 2 or sequence % context:
        return None
    return Hybrid(data=data, context=context, devices=devices)


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """How :func:`plan_step` compiles its candidates: ``measure`` times the steps that fit
    (``steps`` calls each; ``run_steps``: the run it plans for, which a compile must repay);
    ``memory_limit`` in bytes (``None``: the devices'); ``place_batch=False`` lowers on the
    batch's shapes alone (a target's compile-only devices); ``announce`` is told each row as it
    is lowered; ``target`` names the devices planned for; ``first_fit`` stops at the first
    candidate that fits; ``usable``: the fraction of the limit a step may use (the rest is headroom).

    >>> PlanSettings(memory_limit=2**30).measure
    False
    """

    measure: bool = False
    memory_limit: int | None = None
    steps: int = MEASURE_STEPS
    run_steps: int | None = None
    place_batch: bool = True
    announce: Callable[[PlanRow], None] | None = None
    target: str | None = None
    first_fit: bool = False
    usable: float = HEADROOM


#: a candidate ``first_fit`` did not compile: the reason begins so
FIRST_FIT_SKIP = "not compiled (first_fit=True:"


def make_plan(
    candidates: Sequence[Strategy],
    lower: Callable[[Strategy], tuple[jax.stages.Lowered, TreeFunction | None]],
    *,
    memory_limit: int | None = None,
    measure: Callable[[PlanRow], budget_lib.Timing] | None = None,
    alongside: Callable[[], object] | None = None,
    run_steps: int | None = None,
    announce: Callable[[PlanRow], None] | None = None,
    first_fit: bool = False,
    refused: Mapping[int, str] | None = None,
    usable: float = HEADROOM,
) -> MemoryPlan:
    """Compiles ``lower(strategy)`` (a ``jax.stages.Lowered`` and the jitted step it came from,
    kept as the row's ``function``) for each candidate and picks one; with ``first_fit``, one
    at a time in order, stopping at the first that fits (the rest ``skipped``: a slow target's
    compiles are minutes each).

    ``lower`` may raise for a candidate that cannot run this configuration (a batch it cannot
    split, or ``jax.pmap``'s lowering of abstract arguments, which fails across processes); the
    row then carries the message and the candidate is not chosen.
    ``measure(row)`` times steps of ``row.compiled``, for the candidates that fit.
    ``alongside()`` runs in a worker thread beside the compiles (the compile of the state's
    initialisation that measuring needs). With ``measure`` and ``run_steps`` (the steps of the
    run the pick trains), the first candidate that fits is compiled and timed alone, and each
    other one only when it could repay its compile within those steps
    (:mod:`trainkit.planning.budget`); the rest keep the reason in ``skipped``. ``announce(row)``
    is told of each candidate before it is lowered (a progress line), and of it again once compiled.
    ``refused`` (by ``id`` of the candidate): why one cannot run this model at all (a pipeline on a
    model without stacked blocks); its row says so, and nothing is lowered, skipped or timed for it.
    A row fits when its step needs at most ``usable`` of the limit.
    """
    refused = refused or {}
    rows = [PlanRow(strategy, short_name(strategy), error=refused.get(id(strategy))) for strategy in candidates]
    limit = int(memory_limit) if memory_limit is not None else device_memory_limit(candidates[0].devices)
    budget, compare_from = int(usable * limit), None
    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(rows), os.cpu_count() or 1))) as pool:
        side = None if alongside is None else pool.submit(alongside)
        waiting = [row for row in rows if row.error is None]
        compile_rows = functools.partial(_compile_rows, pool, lower=lower, budget=budget, announce=announce)
        if measure is not None and run_steps is not None:  # staged: see the docstring
            waiting, compare_from = _first_timed(compile_rows, waiting, side, measure, run_steps)
        if first_fit:
            _compile_until_one_fits(compile_rows, rows, waiting)
            waiting = []
        compile_rows(waiting)
        _wait(side)
    if measure is not None:
        for row in waiting:
            if row.fits:
                _time(row, measure)
    _recommend(rows)
    return MemoryPlan(rows, limit, measure is not None, compare_from_steps=compare_from)


def _first_timed(
    compile_rows: Callable[[list[PlanRow]], None],
    waiting: list[PlanRow],
    side: concurrent.futures.Future[object] | None,
    measure: Callable[[PlanRow], budget_lib.Timing],
    run_steps: int,
) -> tuple[list[PlanRow], float | None]:
    """:func:`make_plan`'s staged start: the simplest candidate that fits, compiled alone and timed, and the
    others skipped where they could not repay their compile within ``run_steps``. Returns the rows still to
    compile and the step count from which the others compare (``None``: none fit)."""
    first = None
    while waiting and first is None:
        row = waiting.pop(0)
        compile_rows([row])
        first = row if row.fits else None
    if first is None:
        return waiting, None
    _wait(side)  # the state's initialisation compiled: measuring builds the state
    _time(first, measure)
    compare_from = _skip_unprofitable(first, waiting, run_steps)
    return [row for row in waiting if row.skipped is None], compare_from


def _compile_until_one_fits(
    compile_rows: Callable[[list[PlanRow]], None], rows: list[PlanRow], waiting: list[PlanRow]
) -> None:
    """``first_fit``: the waiting candidates compiled one at a time until one fits; the rest skipped."""
    while waiting and not any(row.fits for row in rows):
        compile_rows([waiting.pop(0)])
    fitted = next((row.name for row in rows if row.fits), "")
    for row in waiting:
        row.skipped = f"{FIRST_FIT_SKIP} {fitted} fits)"


def _recommend(rows: list[PlanRow]) -> None:
    """Marks the pick among the rows that fit (process 0's, where timings differ per process)."""
    fitting = [r for r in rows if r.fits]
    if fitting:
        best = rows.index(pick(fitting))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            best = int(multihost_utils.broadcast_one_to_all(np.int32(best)))
        rows[best].recommended = True


def _time(row: PlanRow, measure: Callable[[PlanRow], budget_lib.Timing]) -> None:
    """``row``'s timing, and its step time as the row's measured seconds."""
    row.timing = measure(row)
    row.measured_seconds = row.timing.seconds


def _compile_rows(
    pool: concurrent.futures.ThreadPoolExecutor,
    rows: Sequence[PlanRow],
    lower: Callable[[Strategy], tuple[jax.stages.Lowered, TreeFunction | None]],
    budget: int,
    announce: Callable[[PlanRow], None] | None = None,
) -> None:
    """Lowers each row's candidate and compiles it in ``pool``: XLA compiles without the GIL, so
    each candidate compiles in a thread while the next one is traced and lowered (tracing is
    Python, so it stays on this thread). Fills each row, its ``compile_seconds`` and ``fits``.
    With ``announce`` (a progress line) one at a time: announced once lowered (its
    ``program_ops`` counted, nothing compiled yet), and again once compiled."""
    if announce is not None and len(rows) > 1:
        for row in rows:
            _compile_rows(pool, [row], lower, budget, announce)
        return
    compiling = {}
    for row in rows:
        started = time.perf_counter()
        try:
            with attention_calls() as row.attention:
                program, row.function = lower(row.strategy)
            if not isinstance(program, jax.stages.Lowered):
                raise TypeError(f"{type(row.strategy).__name__}.compile('train', ...)'s result cannot be lowered")
            if announce is not None:
                row.program_ops = compile_estimate.program_ops(program)
                announce(row)
            compiling[id(row)] = (started, pool.submit(program.compile))
        except Exception as error:  # noqa: BLE001 - a candidate that cannot compile is a row, not a crash
            row.error, row.left_out = _failure(error), isinstance(error, NotACandidate)
    for row in rows:
        if id(row) in compiling:
            started, future = compiling[id(row)]
            try:
                analyse(row, future.result())
            except Exception as error:  # noqa: BLE001
                row.error = _failure(error)
                if row.strategy.axis_name is not None and "Unexpected device_id" in str(error):
                    row.error, row.left_out = _PMAP_ACROSS_HOSTS.format(hosts=_hosts(row.strategy)), True
            row.compile_seconds = time.perf_counter() - started
        row.fits = row.error is None and row.total_bytes <= budget
        if announce is not None:
            announce(row)


def _skip_unprofitable(first: PlanRow, rows: Sequence[PlanRow], run_steps: int) -> float | None:
    """Marks ``skipped`` each row that could not repay its compile and timing within
    ``run_steps`` steps after ``first`` was timed (the same rows on every process: process 0
    decides); returns the fewest run steps from which a skipped one would have paid
    (``math.inf``: none ever would; ``None``: none was skipped)."""
    timing = first.timing
    assert timing is not None
    platform, cores = first.strategy.devices[0].platform, budget_lib.host_cores()
    worth = {}
    for row in rows:
        bound = budget_lib.speedup_bound(
            devices=len(row.strategy.devices), platform=platform, busy_cores=timing.busy_cores, cores=cores
        )
        cost = first.compile_seconds + (1 + MEASURE_STEPS) * timing.seconds
        worth[id(row)] = budget_lib.Worth.of(step_seconds=timing.seconds, bound=bound, cost_seconds=cost)
    skips = np.array([not worth[id(row)].pays(run_steps) for row in rows], np.int32)
    if jax.process_count() > 1 and len(rows):
        from jax.experimental import multihost_utils

        skips = np.asarray(multihost_utils.broadcast_one_to_all(skips))
    skipped = [row for row, skip in zip(rows, skips) if skip]
    for row in skipped:
        row.skipped = worth[id(row)].why_not(run_steps)
    return min((worth[id(row)].break_even_steps for row in skipped), default=None)


def _wait(side: concurrent.futures.Future[object] | None) -> None:
    """Waits for the side compile; a failure is a warm-up's: what needs it fails clearly itself."""
    if side is not None and side.exception() is not None:
        logger.debug("the plan's side compile failed: %s", side.exception())


def pick(fitting: Sequence[PlanRow]) -> PlanRow:
    """The row ``"auto"`` picks among those that fit, listed simplest first (SingleDevice,
    DataParallel, FSDP, Hybrid): the first one within ``CLEAR_MARGIN`` of the fastest. A more
    complex strategy must be clearly faster; step times closer than that are within the noise
    of a busy machine, and picking by noise would make two runs of one script differ.

    >>> rows = [PlanRow(None, n, measured_seconds=t) for n, t in (("single", 1.0), ("dp", 0.9), ("fsdp", 0.5))]
    >>> pick(rows).name, pick(rows[:2]).name
    ('fsdp', 'single')
    """
    fastest = min(row.seconds for row in fitting)
    return next(row for row in fitting if row.seconds <= fastest * (1 + CLEAR_MARGIN))


#: why a ``jax.pmap`` candidate is left out of a plan for a compile-only slice of many hosts
_PMAP_ACROSS_HOSTS = (
    "not a candidate here: libtpu cannot compile jax.pmap's program for a slice of {hosts} hosts without them "
    "(its all-reduce numbers devices per host); FSDP and Hybrid hold the same data parallelism under jit"
)


def _hosts(strategy: Strategy) -> int:
    return len({device.process_index for device in strategy.devices})


def _failure(error: Exception) -> str:
    """A plan row's error: the first sentence, with the type unless it is a usage error."""
    message = str(error).split(". ")[0]
    return message if isinstance(error, (ValueError, TypeError)) else f"{type(error).__name__}: {message}"


def state_bytes_per_device(abstract_state: PyTree, shardings: PyTree) -> int:
    """The bytes of the state's largest shard set on one device: each leaf's shard shape under
    its sharding (a lower bound on the step's memory: parameters, optimizer and model state);
    a leaf placed in host memory (offload) counts nothing."""

    def shard_bytes(leaf, sharding) -> int:
        if isinstance(sharding, jax.sharding.Sharding) and in_host_memory(sharding):
            return 0  # offloaded: in host memory, not the device's
        shape = sharding.shard_shape(leaf.shape) if isinstance(sharding, jax.sharding.Sharding) else leaf.shape
        return array_bytes(shape, leaf.dtype)

    return int(sum(jax.tree.leaves(jax.tree.map(shard_bytes, abstract_state, shardings))))


def plan_step(
    host_batch: Batch,
    candidates: Sequence[Strategy],
    *,
    abstract_state: PyTree,
    compile_step: Callable[[Strategy, PyTree], TreeFunction],
    create_state: Callable[[Strategy], PyTree],
    precompile_state: Callable[[Strategy], None] | None = None,
    micro_batches: int = 1,
    trains: bool = True,
    totals: PyTree = None,
    settings: PlanSettings = PlanSettings(),  # noqa: B008 - a frozen value
    refused: Mapping[int, str] | None = None,
) -> MemoryPlan:
    """Lowers and compiles a step on ``host_batch`` (a padded global batch) under each candidate,
    as ``settings`` says (:class:`PlanSettings`).

    ``compile_step(strategy, abstract_state)`` returns the jitted step (``(state, totals, batch) ->
    (state, totals)`` when ``trains``, ``totals`` the host zeros of the metric totals it carries, else
    ``(state, batch) -> outputs``); the abstract state carries each candidate's shardings, so nothing
    is allocated unless ``measure``, which builds one state with ``create_state`` (under the first
    candidate whose state alone fits; its initialisation compiled beside the steps by
    ``precompile_state``) and copies it into each candidate's shardings. Each row keeps its jitted
    step as ``row.function``; a ``compile_step`` that raises :class:`NotACandidate` (it would
    compute another result) leaves the reason in the row, ``left_out``; ``refused``: see :func:`make_plan`.
    """
    memory_limit = settings.memory_limit
    limit = int(memory_limit) if memory_limit is not None else device_memory_limit(candidates[0].devices)
    inputs = _StepInputs(
        host_batch=host_batch,
        abstract_state=abstract_state,
        compile_step=compile_step,
        create_state=create_state,
        micro_batches=micro_batches,
        trains=trains,
        totals=totals,
        settings=settings,
        limit=limit,
        candidates=candidates,
    )
    under = inputs.under  # the candidate the measured state is built under: its initialisation compiled beside
    alongside = None if under is None or precompile_state is None else functools.partial(precompile_state, under)
    result = make_plan(
        candidates,
        inputs.lower,
        memory_limit=memory_limit,
        measure=inputs.run if settings.measure else None,
        alongside=alongside,
        run_steps=settings.run_steps,
        announce=settings.announce,
        first_fit=settings.first_fit,
        refused=refused,
        usable=settings.usable,
    )
    state, under = inputs.built or (None, None)
    return dataclasses.replace(result, initial_state=state, initialised_under=under, target=settings.target)


@dataclasses.dataclass
class _StepInputs:
    """One step's inputs as :func:`plan_step` lowers them under each candidate and runs them when it
    measures; the host state built once (sharded by ``under``, the first candidate whose state alone
    fits, else by the first that needs it), then copied into each candidate's shardings."""

    host_batch: Batch
    abstract_state: PyTree
    compile_step: Callable[[Strategy, PyTree], TreeFunction]
    create_state: Callable[[Strategy], PyTree]
    micro_batches: int
    trains: bool
    totals: PyTree
    settings: PlanSettings
    limit: int
    candidates: Sequence[Strategy]
    built: tuple[PyTree, Strategy] | None = None  # the host state and the candidate it was built under
    under: Strategy | None = dataclasses.field(init=False)  # measuring: the first candidate whose state alone fits

    def __post_init__(self) -> None:
        usable, abstract = self.settings.usable * self.limit, self.abstract_state
        fits = (c for c in self.candidates if state_bytes_per_device(abstract, c.state_sharding(abstract)) <= usable)
        self.under = next(fits, None) if self.settings.measure else None

    def lower(self, strategy: Strategy) -> tuple[jax.stages.Lowered, TreeFunction]:
        pipeline = strategy.microbatches if self.trains else 1
        rows = np.shape(self.host_batch["mask"])[0]
        check_batch_size(rows, strategy.num_batch_shards, micro_batches=self.micro_batches, pipeline=pipeline)
        abstract = _abstract_in(strategy, self.abstract_state, self.limit, self.settings.usable)
        function: Any = self.compile_step(strategy, abstract)  # jitted, pmapped or a LeafStep: it lowers
        placed = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=strategy.replicated()), self.totals
        )
        if strategy.axis_name is not None and jax.process_count() > 1:
            # pmap turns each argument into a global array before lowering, which an abstract
            # one cannot become: lower it with the real state (its size passed the check above)
            abstract = strategy.put_state(self.the_host_state(strategy))
            placed = None if self.totals is None else strategy.put_replicated(self.totals)
        arguments = (abstract, placed) if self.trains else (abstract,)  # the totals as training places them
        local = strategy.local_rows(self.host_batch)  # compile-only target devices take nothing placed
        batch = strategy.put_batch(local) if self.settings.place_batch else strategy.abstract_batch(local)
        return function.lower(*arguments, batch), function

    def the_host_state(self, strategy: Strategy) -> PyTree:
        if self.built is None:
            under = self.under or strategy
            self.built = (distributed.fetch(self.create_state(under)), under)
        return self.built[0]

    def run(self, row: PlanRow) -> budget_lib.Timing:
        strategy, compiled = row.strategy, row.compiled
        assert compiled is not None  # only rows that compiled and fit are measured
        state = strategy.put_state(self.the_host_state(strategy))
        if isinstance(row.function, LeafStep):  # its executable takes the state's carried leaves
            state = row.function.carried(jax.tree.leaves(state))
        batch = strategy.put_batch(strategy.local_rows(self.host_batch))
        totals = strategy.put_replicated(self.totals) if self.trains else None
        return time_steps(compiled, state, batch, self.settings.steps, totals)


#: What a plan row's error says when the candidate failed for memory alone.
MEMORY_ERRORS = ("the state alone needs", "RESOURCE_EXHAUSTED")


def _abstract_in(strategy: Strategy, abstract_state: PyTree, limit: int, usable: float = HEADROOM) -> PyTree:
    """The abstract state in ``strategy``'s shardings; refused (the row's reason) when the
    state alone cannot fit ``limit``, which is not worth a compile."""
    shardings = strategy.state_sharding(abstract_state)
    needed = state_bytes_per_device(abstract_state, shardings)
    if needed > usable * limit:
        raise ValueError(
            f"skipped without compiling: the state alone needs {gib(needed)} per device, above "
            f"{usable:.0%} of the {gib(limit)} limit"
        )
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)


def time_steps(
    step: TreeFunction, state: PyTree, batch: PyTree, steps: int = MEASURE_STEPS, totals: PyTree = None
) -> budget_lib.Timing:
    """The fastest of ``steps`` calls of ``step(state, batch)`` (a training step with
    ``totals``: ``step(state, totals, batch)``, its state threaded) after one warm-up (the
    minimum: other processes on the machine only ever add time), and the cores they kept busy."""

    def call(state):
        out = step(state, batch) if totals is None else step(state, totals, batch)
        jax.block_until_ready(out)
        return state if totals is None else out[0]

    state = call(state)
    times = []
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        start = time.perf_counter()
        state = call(state)
        times.append(time.perf_counter() - start)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return budget_lib.Timing(min(times), cpu / wall if wall > 0 else 1.0)
