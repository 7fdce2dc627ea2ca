"""``as_dataset`` and ``prepare``: Keras-style inputs (arrays, tuples, dicts, iterables, data
library datasets, sources) turned into one source and a global batch size.

>>> import numpy as np
>>> prepared = prepare((np.zeros((10, 2)), np.zeros(10)), needs_targets=True)
>>> type(prepared.source).__name__, prepared.batch_size, prepared.rows, prepared.first_x.shape
('ArrayDataset', 32, 10, (10, 2))
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import jax

from trainkit.data.adapters import adapt
from trainkit.data.arrays import ArrayDataset
from trainkit.data.batching import (
    Batch,
    PyTree,
    abstract_batch,
    check_batch_size,
    is_array_tree,
    num_rows,
    pad_batch,
    split_xyw,
    take,
)
from trainkit.data.iterable import IterableDataset
from trainkit.data.source import DataSource, Source, UserSource

#: Keras's batch size when none is given.
DEFAULT_BATCH_SIZE = 32


class Prepared(NamedTuple):
    """One call's input, resolved once: everything setup reads (objective, target checks, the
    plan's sample, the cross-process check, the state) comes from here; nothing re-parses it.

    Attributes:
        source: the batches, as a :class:`~trainkit.data.source.Source`.
        batch_size: the global batch size.
        first: the first batch's ``(x, y, sample_weight)`` (this process's rows, at most
            ``batch_size``; read once, a random-access source no further).
        spec: the per-example shapes and dtypes of the inputs.
        rows: the rows of one pass when known without reading them, else ``None``.
    """

    source: Source
    batch_size: int
    first: tuple[PyTree, PyTree, PyTree]
    spec: PyTree
    rows: int | None

    @property
    def first_x(self) -> PyTree:
        return self.first[0]

    @property
    def first_y(self) -> PyTree:
        return self.first[1]

    @property
    def has_targets(self) -> bool:
        return self.source.has_targets

    def sample_batch(self, batch_size: int | None = None, abstract: bool = False) -> Batch:
        """The first batch padded to ``batch_size`` (default: this call's) global rows, for
        planning and lowering; ``abstract``: its ``jax.ShapeDtypeStruct`` leaves only (nothing
        read past the first batch, nothing padded: a plan for devices that are not here)."""
        x, y, w = self.first
        size = self.batch_size if batch_size is None else batch_size
        if abstract:
            return abstract_batch(x, y, w, size)
        if size > num_rows(x):  # a larger plan batch than the first batch read: read that many
            x, y, w = self.source.first(size)
        x, y, w = (None if t is None else take(t, slice(0, size)) for t in (x, y, w))
        return pad_batch(x, y, w, size)


def as_dataset(data: Any, y: PyTree = None, sample_weight: PyTree = None) -> Source:
    """Normalises Keras-style inputs: ``(x, y[, w])``, ``x, y``, an iterable of batches, or a
    data library's dataset (:func:`trainkit.data.sources.adapt`); a dataset is returned as it is.
    A dict is the model's inputs (Keras's rule), whatever its keys."""
    if isinstance(data, Source) and y is None and sample_weight is None:
        return data
    if isinstance(data, DataSource) and y is None and sample_weight is None:
        return UserSource(data)
    if y is not None or sample_weight is not None:
        if isinstance(data, tuple) and len(data) in (2, 3) and data[1] is y:
            raise ValueError(
                "fit received the targets twice: x is a tuple (x, y, ...) and y is given again, so the tuple would be "
                "read as the model's inputs. Pass fit((x, y)) or fit(x, y)."
            )
        return ArrayDataset(data, y, sample_weight)
    adapted = adapt(data)
    if adapted is not None:
        return adapted
    if isinstance(data, tuple):
        x, y, w = split_xyw(data)
        if not is_array_tree(x):
            raise TypeError(
                f"x must be an array or a dict of arrays; received {type(x).__name__}. "
                "For batches from a generator, pass the iterable itself as `data`."
            )
        return ArrayDataset(x, y, w)
    if is_array_tree(data):
        return ArrayDataset(data)
    if isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
        raise TypeError(
            f"Cannot train on data of type {type(data).__name__}. Pass a tuple (x, y) or "
            "(x, y, sample_weight) of arrays, x and y as two arguments, an iterable of such "
            "batches, or a dataset of grain, torch, Hugging Face or tf.data (see docs/data.md)."
        )
    return IterableDataset(data)


def own_batch_size(source: Source) -> int | None:
    """The global batch size a source fixes itself (an iterable's batches, times the processes
    that each yield their part), or ``None``."""
    return source.batch_size * jax.process_count() if isinstance(source, IterableDataset) else None


def prepare(
    data: Any,
    y: PyTree = None,
    sample_weight: PyTree = None,
    batch_size: int | None = None,
    *,
    needs_targets: bool = False,
    default_batch_size: int | None = DEFAULT_BATCH_SIZE,
) -> Prepared:
    """The input of one ``fit`` / ``evaluate`` / ``predict`` / ``plan`` / ``init`` call, resolved
    once (:class:`Prepared`): ``batch_size`` (default ``default_batch_size``; ``None``: all the
    rows of arrays, a sample batch) for arrays and random-access sources; an iterable's own
    batches times the processes. Raises before compiling when targets are needed but missing,
    or an iterable's batches contradict ``batch_size``. The first batch is read once."""
    if batch_size is not None:
        check_batch_size(batch_size, 1)
    source = as_dataset(data, y, sample_weight)
    if needs_targets and not source.has_targets:
        hint = ""
        if isinstance(source, ArrayDataset) and isinstance(source.x, dict) and "y" in source.x:
            hint = (
                " A dict given as x is the model's inputs (Keras's rule), so {'x': ..., 'y': ...} is read as two "
                "inputs named 'x' and 'y'; pass the data as a tuple (x, y) instead."
            )
        raise ValueError(
            "The data has no targets: pass (x, y), (x, y, sample_weight) or x and y as two "
            f"arguments (or override compute_loss for a loss without targets).{hint}"
        )
    own = own_batch_size(source)
    if own is not None:
        if batch_size is not None and batch_size != own:
            raise ValueError(
                f"batch_size={batch_size} was given, but the iterable yields batches of "
                f"{own} rows; an iterable's batches set the batch size. "
                "Drop batch_size, or re-batch the iterable."
            )
        batch_size = own
    elif batch_size is None:
        batch_size = default_batch_size
        if batch_size is None:  # a sample batch: all of an array's rows, a default batch of anything else
            batch_size = source.num_examples if isinstance(source, ArrayDataset) else DEFAULT_BATCH_SIZE
    first = source.first(batch_size // jax.process_count() if own is not None else batch_size)
    return Prepared(source, int(batch_size), first, source.element_spec(), source.num_examples)


def check_validation_runs(dataset: Source, runs: int, validation_steps: int | None) -> None:
    """A one-shot iterator (a generator) as ``validation_data`` serves one validation run, or
    several with ``validation_steps`` (each run continues it); refused up front otherwise."""
    if dataset.one_shot and runs > 1 and validation_steps is None:
        raise ValueError(
            f"validation_data is a one-shot iterator (such as a generator), but {runs} epochs validate: the second "
            "validation would find it exhausted. Pass a list or a re-iterable of batches, arrays, or "
            "validation_steps=N (each validation then reads the next N batches)."
        )
