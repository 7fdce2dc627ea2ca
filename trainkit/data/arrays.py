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
        r = request
        local = batch_size // r.process_count
        parts = (self.x, self.y, self.sample_weight)
        plain = all(t is None or isinstance(t, np.ndarray) for t in parts)  # no tree to walk
        for rows in batch_rows(
            self.num_examples, batch_size, r.shuffle, r.seed, r.epoch, r.start, r.process_index, r.process_count
        ):
            if plain:  # single arrays: gathered without a tree walk; a full batch needs no padding
                x = rows_of(self.x, rows)
                y = None if self.y is None else rows_of(self.y, rows)
                w = None if self.sample_weight is None else rows_of(self.sample_weight, rows)
                yield full_batch(x, y, w) if len(x) == local else pad_batch(x, y, w, local)
                continue
            tx, ty, tw = (None if t is None else take(t, rows) for t in parts)
            yield pad_batch(tx, ty, tw, local)


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
