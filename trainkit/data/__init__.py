"""Data: every input of ``fit`` / ``evaluate`` / ``predict`` turned into one source of
fixed-shape, masked NumPy batches, read ahead in the background (imports ``core`` only).

>>> import numpy as np, trainkit as tk
>>> data = tk.data.as_dataset((np.arange(10.0)[:, None], np.arange(10)))
>>> [int(b["mask"].sum()) for b in data.batches(4)]
[4, 4, 2]
"""

from trainkit.data import sources
from trainkit.data.arrays import ArrayDataset, split_validation, with_class_weight
from trainkit.data.batching import (
    Batch,
    abstract_inputs,
    batch_rows,
    check_batch_size,
    check_positive,
    check_rows_kept,
    check_same_inputs,
    check_shuffle,
    describe_shapes,
    example_spec,
    host_array,
    is_array_tree,
    is_spec,
    num_rows,
    one_batch_size,
    pad_batch,
    split_xyw,
    take,
    to_host,
)
from trainkit.data.epochs import continues_across_epochs, epoch_batches, epoch_steps
from trainkit.data.fit_config import FitConfig, Validation, validates
from trainkit.data.iterable import IterableDataset
from trainkit.data.packing import pack
from trainkit.data.prepare import Prepared, as_dataset, check_validation_runs, own_batch_size, prepare
from trainkit.data.random_access import HuggingFaceSource, RandomAccessSource
from trainkit.data.source import FIRST_PASS, BatchRequest, DataInput, DataSource, Source, UserSource

__all__ = [
    "pack",
    "ArrayDataset",
    "Batch",
    "BatchRequest",
    "DataInput",
    "DataSource",
    "FIRST_PASS",
    "FitConfig",
    "HuggingFaceSource",
    "IterableDataset",
    "Prepared",
    "Source",
    "UserSource",
    "Validation",
    "RandomAccessSource",
    "abstract_inputs",
    "as_dataset",
    "batch_rows",
    "check_batch_size",
    "check_positive",
    "check_rows_kept",
    "check_same_inputs",
    "check_shuffle",
    "check_validation_runs",
    "continues_across_epochs",
    "epoch_batches",
    "describe_shapes",
    "epoch_steps",
    "example_spec",
    "is_spec",
    "host_array",
    "is_array_tree",
    "num_rows",
    "one_batch_size",
    "pad_batch",
    "own_batch_size",
    "prepare",
    "sources",
    "split_validation",
    "split_xyw",
    "take",
    "to_host",
    "validates",
    "with_class_weight",
]
