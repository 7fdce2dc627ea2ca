"""Library adapters: a data library's dataset (grain, torch, Hugging Face, tf.data) as a
source, chosen by the input's type, as Keras's data adapters are.

>>> adapt([1, 2]) is None
True
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from trainkit.core.tree import PyTree
from trainkit.data.iterable import IterableDataset
from trainkit.data.random_access import HuggingFaceSource, RandomAccessSource
from trainkit.data.source import Source


class _TensorFlowBatches:
    """A ``tf.data.Dataset`` as a re-iterable of NumPy batches (``as_numpy_iterator`` per
    epoch), with its length when tf.data knows it."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __iter__(self) -> Iterator[PyTree]:
        return iter(self.dataset.as_numpy_iterator())

    def __len__(self) -> int:
        cardinality = int(self.dataset.cardinality())
        if cardinality < 0:  # infinite or unknown
            raise TypeError("tf.data does not know this dataset's length")
        return cardinality


def _listed_batch(batch: Any) -> Any:
    """A torch ``DataLoader``'s batch of ``(x, y)`` examples is a list ``[x, y]``."""
    return tuple(batch) if isinstance(batch, list) else batch


def _absl_flags_parsed() -> None:
    """grain's worker processes (``mp_prefetch``) read an absl flag, which raises
    ``UnparsedFlagAccessError`` outside an absl app: its defaults are taken as parsed."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _yields_batches(dataset: Any) -> bool:
    """Whether a grain ``MapDataset``'s elements are batches: a ``.batch(...)`` somewhere in its
    lineage (grain names that step ``BatchMapDataset``; later maps and shuffles keep batches)."""
    pending = [dataset]
    while pending:
        node = pending.pop()
        if type(node).__name__ == "BatchMapDataset":
            return True
        pending.extend(node.parents)
    return False


def _module(name: str) -> Any:
    """A library already imported by the user (an object of its type implies it), else None."""
    return sys.modules.get(name)


def adapt(data: object) -> Source | None:
    """The :class:`DataSource` for a data library's dataset, or ``None`` when ``data`` is none of
    them (arrays and plain iterables are handled by :func:`trainkit.data.as_dataset`).

    >>> adapt([1, 2]) is None
    True
    """
    grain = _module("grain")
    if grain is not None:
        if isinstance(data, grain.MapDataset):
            # batched (Keras's way of taking grain): its elements are the batches, in its order
            return IterableDataset(data) if _yields_batches(data) else RandomAccessSource(data)
        if isinstance(data, (grain.IterDataset, grain.DataLoader, grain.DatasetIterator)):
            _absl_flags_parsed()
            return IterableDataset(data)
    torch = _module("torch")
    if (
        torch is not None
        and hasattr(torch, "utils")
        and isinstance(data, torch.utils.data.Dataset | torch.utils.data.DataLoader)
    ):
        if isinstance(data, torch.utils.data.DataLoader):
            return IterableDataset(data, convert=_listed_batch)
        if isinstance(data, torch.utils.data.IterableDataset):
            raise TypeError(
                "A torch IterableDataset yields single examples; wrap it in a torch.utils.data.DataLoader("
                "dataset, batch_size=...) so that fit receives batches."
            )
        return RandomAccessSource(data)
    datasets = _module("datasets")
    if datasets is not None:
        if isinstance(data, datasets.Dataset):
            return HuggingFaceSource(data)
        if isinstance(data, datasets.IterableDataset | datasets.DatasetDict):
            raise TypeError(
                f"A Hugging Face {type(data).__name__} cannot be trained on directly: pick a split "
                "(dataset['train']) of a map-style Dataset, or load it without streaming=True."
            )
    tf = _module("tensorflow")
    if tf is not None and isinstance(data, tf.data.Dataset):
        return IterableDataset(_TensorFlowBatches(data))
    return None
