"""Executions: an epoch's host batches grouped into the spans that the batch hooks see.

With ``steps_per_execution=k`` the loop trains ``k`` batches per compiled call: their host
arrays are stacked on a new leading axis (``np.stack``) in the prefetch thread; in-memory
arrays, whose batches the reader names by their rows (:class:`Rows`), are gathered for the
whole call in one take of each array (:class:`Assembly`). Batches that
cannot fill a whole call (the end of the data, or a cut) are trained one by one with the
single-step function, so a fit compiles at most two train shapes (``k`` steps and one step),
and the batch hooks still run once for them all, as Keras's last, shorter execution does. A
call is cut short where training must stop between two steps whatever the callbacks do: at
``max_steps`` and at every ``validation_interval`` step.

>>> import numpy as np
>>> pairs = (({"x": np.full(2, i)}, f"after {i}") for i in range(5))
>>> [(fused, n, state) for _, fused, n, state in executions(pairs, 2, lambda i: 99)]
[(True, 2, 'after 1'), (True, 2, 'after 3'), (False, 1, 'after 4')]
>>> [(fused, n) for _, fused, n, _ in executions(((b, None) for b in range(8)), 3, lambda i: 5 - i % 5)]
[(True, 3), (False, 2), (True, 3)]
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax
import numpy as np

from trainkit.core.tree import JSON, PyTree


class Span(NamedTuple):
    """Batches the hooks see as one execution: ``batches`` stacked into one tree (``fused``,
    trained in one call) or a list trained one call each; ``steps`` of them; ``data_state``: the
    data's position after the last one."""

    batches: PyTree  # a stacked tree, or a list of trees
    fused: bool
    steps: int
    data_state: JSON


class Rows(NamedTuple):
    """A batch of an in-memory source named by its rows, gathered when its span is assembled:
    ``rows``, this process's real rows of it (a slice or indices), ``size``, the rows of the
    padded batch (the real ones repeated, masked); ``offset``, where ``rows`` start in the array
    they are a view of (the epoch's order, their ``.base``), as their producer states it
    (``ArrayDataset.rows``), -1 where they are none: a span of consecutive full batches is then
    that array's slice, not a stack of its batches.

    >>> span_indices([Rows(slice(0, 2), 2), Rows(np.array([3, 2]), 2)])[0].tolist()
    [[0, 1], [3, 2]]
    >>> order = np.array([5, 1, 4, 0, 3, 2])
    >>> span_indices([Rows(order[2:4], 2, 2), Rows(order[4:6], 2, 4)])[0].tolist()
    [[4, 0], [3, 2]]
    """

    rows: slice | np.ndarray
    size: int
    offset: int = -1


def padded_indices(real: np.ndarray, size: int) -> np.ndarray:
    """The indices of a padded batch of ``size`` rows whose real rows are ``real`` (at least
    one): those, then they repeated in order (:func:`~trainkit.data.batching.pad_batch`'s padding).

    >>> padded_indices(np.array([7, 3, 5]), 5).tolist()
    [7, 3, 5, 7, 3]
    """
    count = len(real)
    return real if count == size else np.concatenate([real, real[np.arange(size - count) % count]])


def span_indices(span: list[Rows]) -> tuple[np.ndarray, np.ndarray] | None:
    """The rows of a span's padded batches as one ``(batches, size)`` index array and their
    masks (``None`` where a batch has no real row, a process's empty part of the last batch:
    its span is gathered batch by batch).

    >>> indices, masks = span_indices([Rows(slice(0, 2), 2), Rows(np.array([3]), 2)])
    >>> indices.tolist(), masks.tolist()
    ([[0, 1], [3, 3]], [[1.0, 1.0], [1.0, 0.0]])
    """
    size, count = span[0].size, len(span)
    sliced = one_slice(span)
    if sliced is not None:
        return sliced.reshape(count, size), full_masks(count, size)
    reals = [np.arange(r.rows.start, r.rows.stop) if isinstance(r.rows, slice) else np.asarray(r.rows) for r in span]
    counts = [len(real) for real in reals]
    if 0 in counts:
        return None
    indices = np.stack([padded_indices(real, size) for real in reals])
    if all(count == size for count in counts):
        return indices, full_masks(len(span), size)
    return indices, (np.arange(size) < np.asarray(counts)[:, None]).astype(np.float32)


def one_slice(span: list[Rows]) -> np.ndarray | None:
    """The span's rows as one slice of the order its batches' rows are views of, where they are
    consecutive full batches of it (``Rows.offset``); ``None`` otherwise."""
    first, size = span[0], span[0].size
    if first.offset < 0 or not isinstance(first.rows, np.ndarray) or first.rows.base is None:
        return None
    order = first.rows.base
    for i, named in enumerate(span):
        rows = named.rows
        if not isinstance(rows, np.ndarray) or rows.base is not order or len(rows) != size:
            return None
        if named.offset != first.offset + i * size:
            return None
    last = span[-1].rows
    assert isinstance(last, np.ndarray)  # checked above
    if not (_starts_at(order, first.offset, first.rows) and _starts_at(order, span[-1].offset, last)):
        return None  # the order is itself a view: offsets into it are not into its base
    return order[first.offset : first.offset + len(span) * size]


def _starts_at(order: np.ndarray, offset: int, rows: np.ndarray) -> bool:
    """Whether ``rows`` is ``order``'s view at ``offset``."""
    at = order[offset : offset + 1] if order.ndim == 1 else order[:0]
    return bool(at.size) and at.__array_interface__["data"][0] == rows.__array_interface__["data"][0]


class IndexedSpan(NamedTuple):
    """A fused call's batches named by their rows in data kept on the devices (``fit(...,
    data_on_device=True)``): ``rows``, ``(batches, size)`` indices, and ``mask``, their masks;
    the compiled call gathers the rows itself."""

    rows: np.ndarray
    mask: np.ndarray


@functools.cache
def full_masks(batches: int, rows: int) -> np.ndarray:
    """The stacked masks of ``batches`` full batches of ``rows`` rows, built once per shape and
    shared (read-only), as :func:`~trainkit.core.step.full_mask` is for one batch."""
    masks = np.ones((batches, rows), np.float32)
    masks.setflags(write=False)
    return masks


class Assembly(NamedTuple):
    """How the reader's items become a span's host batches: ``one(item)``, a batch trained in
    a call of its own; ``stacked(items)``, a fused call's batches stacked on a leading axis."""

    one: Callable[..., PyTree]  # of a Rows or a batch, as the reader yields them
    stacked: Callable[..., PyTree]


def stack(batches: list[PyTree]) -> PyTree:
    """Host batches of one structure stacked on a new leading axis.

    >>> stack([{"x": np.zeros((2, 3))}, {"x": np.ones((2, 3))}])["x"].shape
    (2, 2, 3)
    """
    return jax.tree.map(_stacked, *batches)


def _stacked(*arrays: np.ndarray) -> np.ndarray:
    """``np.stack(arrays)``: as one ``concatenate`` where every array has the first one's shape
    and dtype (a span's batches), 2-3x quicker for 32 small batches (a step shorter than its
    dispatch pays it every call)."""
    first = arrays[0]
    if np.ndim(first) and all(a.shape == first.shape and a.dtype == first.dtype for a in arrays):
        return np.concatenate(arrays).reshape((len(arrays), *first.shape))
    return np.stack(arrays)


def _itself(batch: PyTree) -> PyTree:
    return batch


#: The reader's items are the host batches themselves.
AS_READ = Assembly(_itself, stack)


def executions(
    pairs: Iterator[tuple[PyTree | Rows, JSON]],
    size: int | Callable[[], int],
    room: Callable[[int], int],
    assembly: Assembly = AS_READ,
) -> Iterator[Span]:
    """A :class:`Span` per span of ``steps`` batches: ``fused``, the batches
    stacked into one (``steps == size``, one call); otherwise a list of ``steps <= size``
    batches, trained one call each (``size``: an int, or a function read before each span).
    ``pairs`` yields each host batch with the data's position
    after it; ``state`` is the position after the span's last batch. ``room(i)``: how many
    steps may run, uncut, from the ``i``-th batch read here on. An error of the data is raised
    after the span of the batches read before it. ``assembly``: how the items read become
    the span's batches (:class:`Assembly`; by default they are the batches)."""
    one = assembly.one
    read, fixed = 0, size
    current: Callable[[], int] = fixed if callable(fixed) else (lambda: fixed)
    while True:
        size = current()  # steps_per_execution="auto" may change it between spans
        if size == 1:  # one batch per call: nothing to group or cut
            pair = next(pairs, None)
            if pair is None:
                return
            read += 1
            yield Span([one(pair[0])], False, 1, pair[1])
            continue
        want = max(1, min(size, room(read)))
        group: list[tuple[PyTree, JSON]] = []
        try:
            group.extend(itertools.islice(pairs, want))
        except Exception:
            if group:
                yield Span([one(batch) for batch, _ in group], False, len(group), group[-1][1])
            raise
        if not group:
            return
        read += len(group)
        items = [item for item, _ in group]
        if len(group) == size > 1:
            yield Span(assembly.stacked(items), True, size, group[-1][1])
        else:
            yield Span([one(item) for item in items], False, len(group), group[-1][1])


def room_until(step: int, max_steps: int | None, every: int | None) -> Callable[[int], int]:
    """``room`` for :func:`executions`: from ``step`` optimizer steps done, the steps left
    before ``max_steps`` and before the next multiple of ``every`` (validation).

    >>> room = room_until(4, max_steps=10, every=6)
    >>> [room(i) for i in range(6)]
    [2, 1, 4, 3, 2, 1]
    """

    def room(read: int) -> int:
        done = step + read
        left = [np.iinfo(np.int64).max]
        if max_steps is not None:
            left.append(max_steps - done)
        if every:
            left.append(every - done % every)
        return int(min(left))

    return room
