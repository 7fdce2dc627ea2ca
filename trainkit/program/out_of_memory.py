"""A step that does not fit the device's memory, named in trainkit's words: the bytes it needs and
the bytes there are, the largest batch that fits (from compiled plans, as ``find_batch_size`` finds
it, never by trial runs into the error), and what would make this batch fit, in the memory
ladder's order (remat of the repeated blocks, the optimizer's state in host memory, both; then
bf16 parameters). Nothing is lost: the error comes before the step runs (the state is not
donated), so the same trainer then fits at the named batch.

Two doors lead here. Where the device's memory is known (an accelerator reports its limit;
``TRAINKIT_DEVICE_MEMORY`` sets one, also on a CPU), ``fit``'s first train step is compiled before
it runs, as a plan of the trainer's own strategy, and its executable is the one the loop then runs
(nothing compiled twice): a step above the limit is refused there. Elsewhere the device's own
error (XLA's ``RESOURCE_EXHAUSTED``: a TPU's compiler refuses a program above its memory) is
turned into :class:`OutOfMemory` by the loop, with the device's error as ``__cause__``.

>>> known_limit(jax.devices("cpu"))  # a CPU's memory is the host's: no check (unless TRAINKIT_DEVICE_MEMORY)
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence

import jax

from trainkit import data as data_lib
from trainkit.core.checks import OutOfMemory
from trainkit.core.state import TrainState
from trainkit.planning import batch_size as batch_size_lib
from trainkit.planning import ladder as ladder_lib
from trainkit.planning import plan as plan_lib
from trainkit.program.setup import Setup
from trainkit.strategies import Strategy

MEMORY_VARIABLE = plan_lib.MEMORY_VARIABLE


def known_limit(devices: Sequence[jax.Device]) -> int | None:
    """The per-device bytes a step is checked against (:func:`~trainkit.planning.plan.device_memory_limit`:
    ``TRAINKIT_DEVICE_MEMORY``, else what the accelerator reports); ``None`` on a CPU without the
    setting (its memory is the host's, shared)."""
    if not os.environ.get(MEMORY_VARIABLE) and devices[0].platform == "cpu":
        return None
    return plan_lib.device_memory_limit(devices)


def check_train_step(setup: Setup, prepared: data_lib.Prepared) -> None:
    """Before ``fit``'s first step, where the memory is known: the train step compiled as a plan of
    the trainer's strategy at this batch; its executable adopted when it fits (the loop runs it),
    :class:`OutOfMemory` when it does not. Nothing to do under ``"auto"`` (its plan chose a strategy
    that fits) or once the step is compiled."""
    strategy = setup.decided.require_strategy()
    limit = known_limit(strategy.devices)
    if limit is None or setup.auto is not None or setup.compiled.has("train"):
        return
    plan = _planner(setup, prepared, limit, trains=True)(prepared.batch_size, [strategy])
    row = plan.rows[0]
    if row.fits and row.function is not None:
        setup.compiled.adopt("train", row.function, row.compile_seconds)  # compiled once, here
    elif row.too_big:
        raise named(setup, "train", prepared, needed=row.total_bytes or None, limit=limit, reason=row.error)


def named(
    setup: Setup,
    kind: str,
    prepared: data_lib.Prepared,
    *,
    needed: int | None = None,
    limit: int | None = None,
    cause: BaseException | None = None,
    reason: str | None = None,
) -> OutOfMemory:
    """:class:`OutOfMemory` for the ``kind`` step on ``prepared``'s batch: the largest batch and the
    measure that fit, each found by compiling (never by running); ``cause``: the device's error,
    ``reason``: the plan's, when it says more than the bytes."""
    strategy = setup.decided.require_strategy()
    limit = limit or plan_lib.device_memory_limit(strategy.devices)  # TRAINKIT_DEVICE_MEMORY, else the devices'
    size, trains = prepared.batch_size, kind == "train"
    needed = needed or (None if cause is None else bytes_in_message(str(cause)))
    unit = strategy.num_batch_shards * (setup.program.grad_accum_steps if trains else 1)
    plan_at = _planner(setup, prepared, limit, trains=trains)
    fits_at = _largest_batch(plan_at, size, unit, strategy)
    rungs = setup.ladder(prepared.first_x) if trains else []
    fitting = _rung_that_fits(plan_at, size, strategy, rungs)
    needs = f"needs {plan_lib.gib(needed)} per device" if needed else f"does not fit ({reason or 'the device said so'})"
    lines = [
        f"The {kind} step at batch_size={size} under {strategy!r} {needs}; the device has {plan_lib.gib(limit)}.",
        f"  - batch_size={fits_at} fits (compiled, not run; find_batch_size(..., headroom=0) finds it too)"
        if fits_at is not None
        else f"  - no smaller batch fits as it is either (not even {unit} row{'s' if unit > 1 else ''})",
    ]
    if fitting is not None:
        rung, bytes_ = fitting
        lines.append(f"  - this batch fits with {rung.name} ({plan_lib.gib(bytes_)} per device): {_how(rung)}")
    elif rungs:
        lines.append(f"  - neither {' nor '.join(rung.name for rung in rungs)} makes this batch fit")
    if trains:
        lines.append(
            "  - then bf16 parameters, which halve their bytes (precision=tk.Precision(param_dtype='bfloat16', "
            "compute_dtype='bfloat16')), or a strategy that shards the state (FSDP)"
        )
    fix = (
        "at the batch named above"
        if fits_at is not None
        else "with the measure named above"
        if fitting is not None
        else "once the model, its precision or the strategy change as above"
    )
    return OutOfMemory(
        "\n".join(lines) + "\n" + _what_happened(setup.session.state, cause, fix),
        kind=kind,
        batch_size=size,
        needed=needed,
        available=limit,
        fits_at=fits_at,
        measure=None if fitting is None else fitting[0].name,
    )


def _how(rung: ladder_lib.Rung) -> str:
    settings = ([f"remat={rung.remat!r}"] if rung.remat is not None else []) + (["offload='optimizer'"] * rung.offload)
    return f"Trainer({', '.join(settings)})"


def _what_happened(state: TrainState | None, cause: BaseException | None, fix: str) -> str:
    """Whether anything ran, and whether the trainer's ``state`` is still whole; ``fix``: how it fits."""
    if cause is None:
        where = f" ({MEMORY_VARIABLE} set)" if os.environ.get(MEMORY_VARIABLE) else ""
        return f"Nothing was run{where}: the trainer is as it was, and fits {fix}."
    if state is not None and any(isinstance(leaf, jax.Array) and leaf.is_deleted() for leaf in jax.tree.leaves(state)):
        return (
            "The device refused the step after the state was handed to it (donated): the trainer's state is gone. "
            f"Load the last checkpoint (trainer.load or BackupAndRestore) before fitting {fix}."
        )
    return "The device refused the step (its error is this one's __cause__); the trainer's state is whole."


#: where XLA's out-of-memory errors say the bytes needed: TPU's compiler (twice), GPU's allocator
_NEEDED = (r"Used ([\d.]+)([KMGT])i?B? of", r"\(([\d.]+)([KMGT])i?B?\) exceeds", r"allocate ([\d.]+)([KMGT])i?B")


def bytes_in_message(message: str) -> int | None:
    """The bytes a device's out-of-memory error says the program needs: XLA's TPU compiler writes
    ``Used 82.58G of 15.75G hbm`` or ``(82.58G) exceeds available HBM``; its GPU allocator
    ``while trying to allocate 1.23GiB``.

    >>> bytes_in_message("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 82.58G of 15.75G hbm.")
    88669599825
    >>> bytes_in_message("no figure") is None
    True
    """
    for pattern in _NEEDED:
        match = re.search(pattern, message)
        if match:
            return int(float(match[1]) * 1024 ** "KMGT".index(match[2]) * 1024)
    return None


#: ``plan_at(size, candidates)``: the step compiled (never run) at a global batch of ``size`` rows
PlanAt = Callable[[int, Sequence[Strategy]], plan_lib.MemoryPlan]


def _planner(setup: Setup, prepared: data_lib.Prepared, limit: int, *, trains: bool) -> PlanAt:
    """The train step (``trains``; else the predict step) of ``setup``'s program compiled (never run)
    on the first rows of ``prepared``'s batch under given candidates; a strategy fits when its step's
    bytes are within the whole ``limit`` (the device's own rule)."""
    settings = plan_lib.PlanSettings(memory_limit=limit, usable=1.0)
    statistics, program = (setup.compiled.statistics if trains else None), setup.program

    def plan_at(size: int, candidates: Sequence[Strategy]) -> plan_lib.MemoryPlan:
        batch = prepared.sample_batch(size)  # this batch's first rows: nothing read past them
        return program.plan(batch, candidates, trains=trains, statistics=statistics, settings=settings)

    return plan_at


def _largest_batch(plan_at: PlanAt, size: int, unit: int, strategy: Strategy) -> int | None:
    """The largest of ``unit * 2**k`` below ``size`` whose step fits (a bisection of compiles)."""
    below = [candidate for candidate in batch_size_lib.candidate_sizes(unit, max(unit, size)) if candidate < size]
    index = batch_size_lib.bisect(below, lambda candidate: plan_at(candidate, [strategy]).recommended is not None)
    return below[index] if index >= 0 else None


def _rung_that_fits(
    plan_at: PlanAt, size: int, strategy: Strategy, rungs: Sequence[ladder_lib.Rung]
) -> tuple[ladder_lib.Rung, int] | None:
    """The first memory measure (:mod:`trainkit.planning.ladder`, cheapest first) under which the
    train step at ``size`` fits, and its bytes; ``None``: none does."""
    for rung in rungs:
        measured = rung.applied(strategy)
        if measured is None:
            continue
        row = plan_at(size, [measured]).rows[0]
        if row.fits:
            return rung, row.total_bytes
    return None
