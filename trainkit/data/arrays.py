"""``ArrayDataset``: in-memory arrays as a random-access source; Keras's ``validation_split`` and
``class_weight``, which only arrays support.

>>> import numpy as np
>>> data = ArrayDataset(np.arange(10.0)[:, None], np.arange(10))
>>> [int(b["mask"].sum()) for b in data.batches(4)]
[4, 4, 2]
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import jax
import numpy as np

from trainkit.core import checks
from trainkit.data.batching import (
    Batch,
    PyTree,
    batch_rows,
    check_lengths,
    check_no_number_lists,
    example_spec,
    full_batch,
    pad_batch,
    rows_of,
    take,
    to_host,
)
from trainkit.data.source import FIRST_PASS, BatchRequest, Source
from trainkit.data.spans import IndexedSpan, Rows, span_indices, stack

#: The largest batch (bytes of x and y) that the loop assembles in its own thread.
QUICK_BATCH_BYTES = 256 * 1024


class ArrayDataset(Source):
    """In-memory arrays, batched in a (seeded) shuffled order, last batch padded."""

    def __init__(self, x: PyTree, y: PyTree = None, sample_weight: PyTree = None):
        check_no_number_lists({"x": x, "y": y, "sample_weight": sample_weight})
        x, y, sample_weight = to_host(x), to_host(y), to_host(sample_weight)
        self.num_examples: int = check_lengths({"x": x, "y": y, "sample_weight": sample_weight})
        self.x, self.y = x, y
        checks.numeric(self.x, "x")
        checks.numeric(self.y, "y")
        self.sample_weight = checks.sample_weights(sample_weight, self.num_examples)

    @property
    def has_targets(self) -> bool:
        return self.y is not None

    def element_spec(self) -> PyTree:
        return example_spec(self.x)

    def first(self, rows: int = 1) -> tuple[PyTree, PyTree, PyTree]:
        sl = slice(0, rows)
        weights = None if self.sample_weight is None else self.sample_weight[sl]
        return take(self.x, sl), None if self.y is None else take(self.y, sl), weights

    def steps(self, batch_size: int) -> int:
        return -(-self.num_examples // batch_size)

    def assembles_quickly(self, batch_size: int) -> bool:
        """A gather of up to ``QUICK_BATCH_BYTES``: measured on a 2-core CPU (MLP 32-64-10,
        batch 32), reading such batches in the loop's thread trained 13% faster than handing
        them over from the prefetch thread; larger gathers overlap the device's step there."""
        row_bytes = sum(a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in jax.tree.leaves((self.x, self.y)))
        return bool(row_bytes * batch_size <= QUICK_BATCH_BYTES)

    def batches(self, batch_size: int, request: BatchRequest = FIRST_PASS) -> Iterator[Batch]:
        """Batches of ``batch_size`` rows from batch index ``request.start`` on.

        With several processes, every process computes the same (seeded) order and yields only
        its part of each global batch: rows ``[p * b, (p + 1) * b)`` of the padded global batch,
        ``b = batch_size / process_count``, so the parts of all processes, in process order,
        are exactly the single-process batch."""
        for rows in self.rows(batch_size, request):
            yield self.gather(rows)

    gathers_rows = True

    def rows(self, batch_size: int, request: BatchRequest = FIRST_PASS) -> Iterator[Rows]:
        """:meth:`batches` named by their rows, nothing gathered (:meth:`gather` and
        :meth:`gather_stacked` gather them)."""
        r = request
        local = batch_size // r.process_count
        whole = r.process_count == 1  # each batch's rows a view of the epoch's order, where it is shuffled
        for index, rows in enumerate(
            batch_rows(
                self.num_examples, batch_size, r.shuffle, r.seed, r.epoch, r.start, r.process_index, r.process_count
            ),
            start=r.start,
        ):
            yield Rows(rows, local, index * batch_size if whole else -1)

    def gather(self, named: Rows) -> Batch:
        """The batch ``named`` names, padded to its size with its real rows repeated."""
        local, rows = named.size, named.rows
        parts = (self.x, self.y, self.sample_weight)
        if all(t is None or isinstance(t, np.ndarray) for t in parts):  # single arrays: no tree to walk
            x = rows_of(self.x, rows)
            y = None if self.y is None else rows_of(self.y, rows)
            w = None if self.sample_weight is None else rows_of(self.sample_weight, rows)
            return full_batch(x, y, w) if len(x) == local else pad_batch(x, y, w, local)
        tx, ty, tw = (None if t is None else take(t, rows) for t in parts)
        return pad_batch(tx, ty, tw, local)

    def gather_stacked(self, span: list[Rows]) -> Batch:
        """The batches of ``span`` stacked on a leading axis, as :func:`~trainkit.data.spans.stack`
        of their :meth:`gather` s, with one take of each array for the whole span (a fused
        call's input in one piece)."""
        named = span_indices(span)
        if named is None:  # a process's empty part of the last batch: nothing to index
            stacked: Batch = stack([self.gather(rows) for rows in span])
            return stacked
        return self.gather_indices(*named)

    def gather_indices(self, indices: np.ndarray, mask: np.ndarray) -> Batch:
        """The batch (or stacked batches) of the rows ``indices`` (any leading shape) with ``mask``."""
        batch: Batch = {"x": take(self.x, indices)}
        if self.y is not None:
            batch["y"] = take(self.y, indices)
        if self.sample_weight is not None:
            batch["sample_weight"] = np.asarray(rows_of(self.sample_weight, indices), np.float32)
        batch["mask"] = mask
        return batch

    def indexed_stacked(self, span: list[Rows]) -> IndexedSpan | Batch:
        """``span`` as the rows a call gathers from :meth:`table` on the devices (its stacked
        host batches where a batch has no real row)."""
        named = span_indices(span)
        if named is None:
            return self.gather_stacked(span)
        return IndexedSpan(named[0].astype(np.int32), named[1])

    def table(self) -> Batch:
        """Every row, as the devices keep it under ``data_on_device``: the batch's parts
        without ``mask`` (weights in float32, as batches carry them)."""
        table: Batch = {"x": self.x}
        if self.y is not None:
            table["y"] = self.y
        if self.sample_weight is not None:
            table["sample_weight"] = np.asarray(self.sample_weight, np.float32)
        return table


def _arrays_only(dataset: Source, what: str) -> ArrayDataset:
    if not isinstance(dataset, ArrayDataset):
        raise ValueError(
            f"{what} is only supported for arrays (x, y[, sample_weight]); received an iterable of batches. "
            "Split or weight the data before batching it, or pass validation_data / per-row sample weights."
        )
    return dataset


def split_validation(dataset: Source, validation_split: float) -> tuple[ArrayDataset, ArrayDataset]:
    """Keras's ``validation_split``: the last ``validation_split`` fraction of the rows (before
    any shuffling) becomes the validation set."""
    arrays = _arrays_only(dataset, "validation_split")
    if not 0.0 < validation_split < 1.0:
        raise ValueError(f"validation_split must be between 0 and 1; received {validation_split!r}.")
    n = arrays.num_examples
    split_at = int(np.floor(n * (1.0 - validation_split)))
    if split_at in (0, n):
        raise ValueError(
            f"Training data contains {n} samples, which is not sufficient to split it into a validation and "
            f"training set as specified by `validation_split={validation_split}`. Either provide more data, or a "
            "different value for the `validation_split` argument."
        )
    part = lambda tree, rows: None if tree is None else jax.tree.map(lambda a: a[rows], tree)  # noqa: E731
    train, val = slice(0, split_at), slice(split_at, n)
    return (
        ArrayDataset(part(arrays.x, train), part(arrays.y, train), part(arrays.sample_weight, train)),
        ArrayDataset(part(arrays.x, val), part(arrays.y, val), part(arrays.sample_weight, val)),
    )


def with_class_weight(dataset: Source, class_weight: Mapping[int, float]) -> ArrayDataset:
    """Keras's ``class_weight``: every row weighted by its class (integer labels, ``(B, 1)``
    labels or one-hot targets), 1.0 for classes not in the dict."""
    arrays = _arrays_only(dataset, "class_weight")
    if not isinstance(class_weight, Mapping):
        raise ValueError(f"class_weight must be a dict of class index -> weight; received {class_weight!r}.")
    if arrays.sample_weight is not None:
        raise ValueError(
            "You cannot use `class_weight` and `sample_weight` at the same time: fold the class "
            "weights into sample_weight."
        )
    if arrays.y is None or len(jax.tree.leaves(arrays.y)) != 1:
        raise ValueError("class_weight needs one array of targets; for several outputs pass sample_weight.")
    try:
        weights = {int(k): float(v) for k, v in class_weight.items()}
    except (TypeError, ValueError):
        raise ValueError(
            f"class_weight keys must be class indices (integers); received {list(class_weight)}."
        ) from None
    y = np.asarray(jax.tree.leaves(arrays.y)[0])
    if y.ndim > 1:
        y = np.argmax(y, axis=-1) if y.shape[-1] != 1 else y[..., 0]
    classes = np.round(y).astype(np.int64).reshape(len(y))
    sample_weight = np.array([weights.get(int(c), 1.0) for c in classes], np.float32)
    return ArrayDataset(arrays.x, arrays.y, sample_weight)
