"""What the loop and a ``fit`` share: steps read in order a few behind their dispatch, device
totals read on the host, this process's slice of a batch, and ``Preempted``.

>>> list(in_order(iter(range(5)), lag=2))
[0, 1, 2, 3, 4]
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator
from typing import TypeVar

import jax
import numpy as np

from trainkit import distributed
from trainkit.core.totals import EpochTotals, PackedTotals, compute
from trainkit.core.tree import PyTree
from trainkit.data.source import BatchRequest
from trainkit.record.session import Session

T = TypeVar("T")

#: Exit status of a run stopped by SIGTERM (preemption) after writing its backup: 128 + SIGTERM.
PREEMPTED_EXIT_CODE = 143


class Preempted(SystemExit):
    """Raised by ``fit`` after a preemption request (SIGTERM under ``BackupAndRestore``) once
    ``on_train_end`` ran and the backup is on disk. A ``SystemExit`` with status 143: uncaught,
    the process exits quietly with the status job schedulers expect; running the same command
    again resumes."""

    def __init__(self, step: int):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step

    def __str__(self) -> str:
        return f"training preempted after step {self.step}; run the same command again to resume"


def this_process(request: BatchRequest, share: tuple[int, int]) -> BatchRequest:
    """``request`` for this process's part of every global batch: ``share`` (``(index, count)``,
    the strategy's :meth:`~trainkit.strategies.Strategy.batch_share`; all of it on one process)."""
    return dataclasses.replace(request, process_index=share[0], process_count=share[1])


def in_order(dispatched: Iterator[T], lag: int) -> Iterator[T]:
    """Yields ``dispatched``'s items in order, each once ``lag`` newer ones were dispatched
    (``lag=0``: at once). The device results of a yielded item are then read while ``lag``
    steps still run: the device never waits for the host, and the queue stays bounded."""
    pending: collections.deque[T] = collections.deque()
    for item in dispatched:
        pending.append(item)
        if len(pending) > lag:
            yield pending.popleft()
    yield from pending


def logs_of(totals: PackedTotals, order: tuple[str, ...]) -> dict[str, float]:
    """The logs of device ``totals``: read to the host (:func:`host_metrics`) and computed in ``order``."""
    return compute(host_metrics(totals).metrics, order)


def host_metrics(totals: PackedTotals) -> EpochTotals:
    """Device totals (packed) -> host float64 totals (gathered across processes when needed). On
    one process each array is read directly, where ``jax.device_get``'s overhead would be a fifth
    of a small model's step. The last totals read are kept: a batch's logs and a callback that
    reads the same totals (``GradientStats``) read the device once."""
    last = _last_read[0]
    if last is not None and last[0] is totals:
        return last[1]
    if jax.process_count() > 1:
        host = distributed.fetch(totals)
    else:
        host = totals.replace(arrays=tuple(np.asarray(a) for a in totals.arrays))
    result: EpochTotals = jax.tree.map(np.float64, host.unpack())
    _last_read[0] = (totals, result)
    return result


def host_metric(totals: PackedTotals, name: str) -> PyTree:
    """One metric of device ``totals`` on the host: on one process only the arrays holding it are
    read (a metric packed apart is one small array: a due step of ``GradientStats`` reads that)."""
    last = _last_read[0]
    if (last is not None and last[0] is totals) or jax.process_count() > 1:
        return host_metrics(totals).metrics[name]
    return totals.read_metric(name)


#: the last ``(device totals, host totals)`` :func:`host_metrics` read (the device arrays are immutable)
_last_read: list[tuple[PackedTotals, EpochTotals] | None] = [None]


def first_non_finite(session: Session) -> tuple[int, int, float] | None:
    """For a train-batch-end hook: the optimizer step (from 1) and the batch of this epoch whose
    loss was first not finite, and that loss, or ``None`` while every loss is finite. With
    ``steps_per_execution`` the hook's batch is the execution's last; this is the one that
    went wrong. Reads the device totals (call it after seeing a non-finite loss)."""
    carry, start = session.carry, session.epoch_start
    if carry is None:
        return None
    host = host_metrics(carry)
    bad = int(host.first_non_finite)
    return (start.step + bad, start.batch + bad - 1, float(host.first_non_finite_loss)) if bad else None


def concatenate(parts: list[PyTree]) -> PyTree:
    """Row blocks of one structure joined along the rows."""
    return jax.tree.map(lambda *a: np.concatenate(a), *parts)
