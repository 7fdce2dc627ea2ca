"""Planning and tuning a trainer's setup without training it: the compiled memory ``plan`` of a
sample batch (docs/strategies.md) and ``find_batch_size``, the largest batch whose compiled
train step fits (docs/tuning.md). Functions of a :class:`~trainkit.program.setup.Setup`, which
:class:`trainkit.Trainer`'s methods of the same names call.

>>> import numpy as np, optax, flax.linen as nn, trainkit as tk
>>> trainer = tk.Trainer(nn.Dense(2), loss="mse", optimizer=optax.sgd(0.1), strategy="single")
>>> x, y = np.ones((100, 3), np.float32), np.ones((100, 2), np.float32)
>>> find_batch_size(trainer.setup, x, y, max_batch_size=64, memory_limit=2**30, verbose=0).batch_size
64
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypedDict

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_compilation_cache

from trainkit import data as data_lib
from trainkit import distributed
from trainkit.core import checks
from trainkit.core.tree import PyTree
from trainkit.data import shapes as shapes_lib
from trainkit.planning import batch_size as batch_size_lib
from trainkit.planning import compile_estimate
from trainkit.planning import plan as plan_lib
from trainkit.planning import targets as targets_lib
from trainkit.program import inputs
from trainkit.program.setup import Setup
from trainkit.strategies import FSDP, DataParallel, Hybrid, Strategy


class PlanOptions(TypedDict, total=False):
    """``Trainer.plan``'s options (:func:`plan`'s defaults)."""

    batch_size: int | None
    candidates: Sequence[Strategy] | None
    measure: bool
    memory_limit: int | str | None
    steps: int
    verbose: int
    target: str | None
    first_fit: bool
    add_measures: bool


class BatchSizeOptions(TypedDict, total=False):
    """``Trainer.find_batch_size``'s options (:func:`find_batch_size`'s defaults)."""

    max_batch_size: int
    memory_limit: int | str | None
    powers_of_two: bool
    verbose: int
    target: str | None
    headroom: float | None


def plan(
    setup: Setup,
    sample_batch: Any,
    *,
    batch_size: int | None = None,
    candidates: Sequence[Strategy] | None = None,
    measure: bool = False,
    memory_limit: int | str | None = None,
    steps: int = plan_lib.MEASURE_STEPS,
    verbose: int = 1,
    target: str | None = None,
    first_fit: bool = False,
    add_measures: bool = True,
) -> plan_lib.MemoryPlan:
    """:meth:`trainkit.Trainer.plan`: the sample batch (any form ``fit`` takes) prepared and
    the train step (predict step without targets) compiled under each candidate; for a
    ``target`` (:mod:`trainkit.planning.targets`) on its compile-only devices, nothing placed;
    ``candidates`` by default: a ``tk.strategies.Auto``'s own, else the defaults;
    ``first_fit``: the candidates compiled in order, up to the first that fits; ``add_measures``:
    when none fits, the memory measures in turn (:mod:`trainkit.planning.ladder`).
    A batch of ``jax.ShapeDtypeStruct`` is planned from its shapes, never built."""
    shapes = shapes_lib.is_shapes(sample_batch)
    if shapes and measure:
        raise ValueError(
            "measure=True times steps on data, but the sample batch is jax.ShapeDtypeStruct shapes: pass arrays "
            "to measure, or plan from shapes with measure=False (the compiler's estimate)."
        )
    prepared = data_lib.prepare(shapes_lib.stand_in(sample_batch), batch_size=batch_size, default_batch_size=None)
    settings = plan_lib.PlanSettings(
        measure=measure, memory_limit=checks.byte_count(memory_limit), steps=steps, first_fit=first_fit
    )
    abstract = shapes or target is not None
    if target is not None:
        resolved = targets_lib.parse(target)
        if measure:
            raise ValueError(f"measure=True times steps on this machine's devices; {target!r} is compiled, not run.")
        candidates = target_candidates(candidates, resolved)
        announce = _progress(resolved) if verbose and distributed.is_main_process() else None
        limit = settings.memory_limit or resolved.memory_limit
        settings = dataclasses.replace(settings, memory_limit=limit, target=target, announce=announce)
        with without_persistent_cache():  # a compile-only executable cannot be cached or read back
            return setup.plan(prepared, candidates, settings, verbose=verbose, abstract=abstract, ladder=add_measures)
    if candidates is None and setup.auto is not None and setup.auto.candidates is not None:
        candidates = setup.auto.candidates  # what "auto" chooses from, so the plan's pick is fit's
    return setup.plan(prepared, candidates, settings, verbose=verbose, abstract=abstract, ladder=add_measures)


@contextlib.contextmanager
def without_persistent_cache() -> Iterator[None]:
    """JAX's persistent compilation cache off while the block runs (a target's compiles), as it
    was after. JAX decides once per process whether the cache is used (at the first compile), so
    the setting alone changes nothing once anything compiled: the decision is reset on the way in
    and out. Without that, a target's executable was written to the cache and, in the next run,
    read back with a warning (``Error reading persistent compilation cache entry``)."""
    before = jax.config.values["jax_enable_compilation_cache"]
    jax.config.update("jax_enable_compilation_cache", False)
    jax_compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        jax_compilation_cache.reset_cache()


def target_candidates(
    given: Sequence[str | Strategy | Callable[[list[jax.Device]], Strategy]] | None, target: targets_lib.Target
) -> list[Strategy]:
    """The candidates on ``target``'s devices: by default DataParallel, FSDP, (on several
    hosts, or 4 devices and more) a Hybrid of data across hosts x FSDP inside each, and (on
    several slices) a pipeline of the slices x FSDP inside each; ``given``: names (``"dp"``,
    ``"fsdp"``, ``"hybrid"``, ``"pipeline"``), functions ``devices -> Strategy`` (a Hybrid with
    a model axis and its rules, say) or strategies already built on the target's devices."""
    devices = target.devices()
    n, hosts = len(devices), target.hosts if target.hosts > 1 else (2 if len(devices) >= 4 else 1)
    named: dict[str, Callable[[], Strategy]] = {"dp": lambda: DataParallel(devices), "fsdp": lambda: FSDP(devices)}
    if hosts > 1 and n % hosts == 0 and n // hosts > 1:
        named["hybrid"] = lambda: Hybrid(data=hosts, fsdp=n // hosts, devices=devices)
    if target.slices > 1:  # across slices only: inside one, a pipeline loses to FSDP (docs/large_models.md)
        named["pipeline"] = lambda: Hybrid(stage=target.slices, fsdp=n // target.slices, devices=devices)
    chosen = []
    for entry in given if given is not None else list(named):
        if isinstance(entry, str):
            if entry not in named:
                raise ValueError(f"Unknown candidate {entry!r} for {target.spec!r}: one of {sorted(named)}.")
            chosen.append(named[entry]())
        elif isinstance(entry, Strategy):
            chosen.append(entry)
        else:
            chosen.append(entry(devices))
    return chosen


def _progress(target: targets_lib.Target) -> Callable[[plan_lib.PlanRow], None]:
    """A progress line per candidate: which one is compiling for ``target`` and about how long it
    will take (its program's size at the rate of the compiles before it), then its time."""
    rates = compile_estimate.CompileRates()

    def announce(row: plan_lib.PlanRow) -> None:
        devices = f"{len(row.strategy.devices)} {target.chip.name}"
        if row.compiled is None and row.error is None:  # lowered, not compiled yet
            about = compile_estimate.duration(rates.estimate(row.program_ops, target.platform))
            print(
                f"compiling {row.name} for {target.spec} ({devices}): {row.program_ops:,} operations, about {about} ..."
            )
        else:
            rates.observe(row.program_ops, target.platform, row.compile_seconds)
            print(f"  {row.name}: compiled in {row.compile_seconds:.1f} s" + (f" ({row.error})" if row.error else ""))

    return announce


def _search_space(
    setup: Setup, resolved: targets_lib.Target | None, rows: int | None
) -> tuple[list[Strategy], int, int | None, int, str]:
    """What :func:`find_batch_size` searches: the candidates (the setup's strategy or ``"auto"``'s, or a
    target's on its compile-only devices), the unit the sizes are multiples of, the sample's rows that cap
    them (``None`` for a target), the memory limit by default, and the ``" for <target>"`` it prints."""
    if resolved is None:
        candidates = inputs.candidate_strategies(setup)
        unit = inputs.batch_unit(candidates, setup.program.grad_accum_steps)
        return candidates, unit, rows, plan_lib.device_memory_limit(candidates[0].devices), ""
    candidates = target_candidates(None, resolved)
    unit = max(c.num_batch_shards for c in candidates) * setup.program.grad_accum_steps
    return candidates, unit, None, resolved.memory_limit, f" for {resolved.spec}"


def find_batch_size(
    setup: Setup,
    x: Any,
    y: PyTree = None,
    *,
    max_batch_size: int = 2**16,
    memory_limit: int | str | None = None,
    powers_of_two: bool = True,
    verbose: int = 1,
    target: str | None = None,
    headroom: float | None = None,
) -> batch_size_lib.BatchSizeSearch:
    """:meth:`trainkit.Trainer.find_batch_size`: the train step planned (compiled, never run)
    at the sizes a bisection picks, under the setup's strategy or ``"auto"``'s candidates (for a
    ``target``, its candidates on its compile-only devices, nothing placed, and sizes not capped
    by the sample's rows); printed on the main process with ``verbose``. When not even the
    smallest size fits, the plan's memory measures are tried in turn, as ``plan`` does. ``headroom``: the
    fraction of the memory kept free (default 10%, 5% on a TPU, whose compiler counts the whole program:
    ``plan.usable_share``), printed with the answer."""
    resolved = None if target is None else targets_lib.parse(target)
    shapes = shapes_lib.is_shapes((x, y))
    prepared = data_lib.prepare(shapes_lib.stand_in(x), shapes_lib.stand_in(y))
    if resolved is None and setup.session.state is not None:
        data_lib.check_same_inputs(setup.decided.input_spec, prepared.spec)
    trains = prepared.has_targets or setup.custom_loss
    if prepared.has_targets:
        setup.build_objective(prepared)
    candidates, unit, rows, default_limit, where = _search_space(setup, resolved, prepared.rows)
    platform = candidates[0].devices[0].platform
    usable = plan_lib.usable_share(platform) if headroom is None else 1 - checks.fraction(headroom, "headroom")
    # a compile-only executable cannot be cached or read back
    cache: contextlib.AbstractContextManager[object] = (
        contextlib.nullcontext() if resolved is None else without_persistent_cache()
    )
    sizes = batch_size_lib.candidate_sizes(unit, int(max_batch_size), powers_of_two, rows=rows)
    abstract = shapes or resolved is not None  # nothing placed
    target = None if resolved is None else resolved.spec

    def plan_at(size: int, limit: int, among: Sequence[Strategy] | None) -> plan_lib.MemoryPlan:
        batch = prepared.sample_batch(size, abstract=abstract)
        statistics = setup.compiled.statistics  # the last fit's, as its steps are compiled
        settings = plan_lib.PlanSettings(memory_limit=limit, place_batch=not abstract, target=target, usable=usable)
        chosen = candidates if among is None else among
        return setup.program.plan(batch, chosen, trains=trains, statistics=statistics, settings=settings)

    rungs = (lambda: setup.ladder(prepared.first_x)) if trains else None  # the plan's ladder, when nothing fits
    with cache:
        limit = checks.byte_count(memory_limit)
        result = batch_size_lib.search(plan_at, sizes, limit, default_limit, rungs, headroom=1 - usable)
    if verbose and distributed.is_main_process():
        print(f"find_batch_size{where}: {result}")
    return result
