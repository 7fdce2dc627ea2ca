"""``as_dataset`` and ``prepare``: Keras-style inputs (arrays, tuples, dicts, iterables, data
library datasets, sources) turned into one source and a global batch size.

>>> import numpy as np
>>> dataset, batch_size = prepare((np.zeros((10, 2)), np.zeros(10)), None, None, None, needs_targets=True)
>>> type(dataset).__name__, batch_size
('ArrayDataset', 32)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax

from trainkit.data.adapters import adapt
from trainkit.data.arrays import ArrayDataset
from trainkit.data.batching import Batch, PyTree, is_array_tree, pad_batch, split_xyw
from trainkit.data.iterable import IterableDataset
from trainkit.data.source import DataSource

Dataset = ArrayDataset | IterableDataset


def as_dataset(data: Any, y: PyTree = None, sample_weight: PyTree = None) -> Dataset:
    """Normalises Keras-style inputs: ``(x, y[, w])``, ``x, y``, an iterable of batches, or a
    data library's dataset (:func:`trainkit.data.sources.adapt`); a dataset is returned as it is.
    A dict is the model's inputs (Keras's rule), whatever its keys."""
    if isinstance(data, DataSource) and y is None and sample_weight is None:
        return data
    if y is not None or sample_weight is not None:
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


def prepare(
    data: Any, y: PyTree, sample_weight: PyTree, batch_size: int | None, *, needs_targets: bool
) -> tuple[Dataset, int]:
    """A dataset and the global batch size for one ``fit`` / ``evaluate`` / ``predict`` call:
    ``batch_size`` (default 32) for arrays; an iterable's own batches times the processes.
    Raises before compiling when targets are needed but missing, or an iterable's batches
    contradict ``batch_size``."""
    dataset = as_dataset(data, y, sample_weight)
    if needs_targets and not dataset.has_targets:
        hint = ""
        if isinstance(dataset, ArrayDataset) and isinstance(dataset.x, dict) and "y" in dataset.x:
            hint = (
                " A dict given as x is the model's inputs (Keras's rule), so {'x': ..., 'y': ...} is read as two "
                "inputs named 'x' and 'y'; pass the data as a tuple (x, y) instead."
            )
        raise ValueError(
            "The data has no targets: pass (x, y), (x, y, sample_weight) or x and y as two "
            f"arguments (or override compute_loss for a loss without targets).{hint}"
        )
    if isinstance(dataset, IterableDataset):
        if batch_size is not None and batch_size != dataset.batch_size:
            raise ValueError(
                f"batch_size={batch_size} was given, but the iterable yields batches of "
                f"{dataset.batch_size} rows; an iterable's batches set the batch size. "
                "Drop batch_size, or re-batch the iterable."
            )
        return dataset, dataset.batch_size * jax.process_count()  # each process yields its part
    return dataset, 32 if batch_size is None else batch_size


def sample_batch(dataset: Dataset, batch_size: int) -> Batch:
    """The dataset's first ``batch_size`` rows as one padded global batch (for planning)."""
    x, y, w = dataset.first(batch_size)
    return pad_batch(x, y, w, batch_size)


def check_validation_runs(dataset: Dataset, runs: int, validation_steps: int | None) -> None:
    """A one-shot iterator (a generator) as ``validation_data`` serves one validation run, or
    several with ``validation_steps`` (each run continues it); refused up front otherwise."""
    if getattr(dataset, "one_shot", False) and runs > 1 and validation_steps is None:
        raise ValueError(
            f"validation_data is a one-shot iterator (such as a generator), but {runs} epochs validate: the second "
            "validation would find it exhausted. Pass a list or a re-iterable of batches, arrays, or "
            "validation_steps=N (each validation then reads the next N batches)."
        )
