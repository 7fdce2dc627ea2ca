"""Data sources: the protocol every input of ``fit`` / ``evaluate`` / ``predict`` becomes, and
the adapters that turn a data library's dataset into one, chosen by the input's type (as
Keras's data adapters are).

Two kinds, by how the rows can be reached:

- **Random access** (:class:`RandomAccessSource`): in-memory arrays, grain's ``MapDataset``,
  a Hugging Face ``datasets.Dataset``, a torch map-style ``Dataset``. trainkit orders,
  shuffles (by seed and epoch), batches and pads the rows itself, each process reads only its
  part of every global batch, and a resume starts at the saved batch index without reading
  the batches before it. The same rows in the same order as the array path, so the same
  parameters.
- **Iterators of batches** (:class:`trainkit.data.IterableDataset`): a Python iterable, grain's
  ``IterDataset`` / ``DataLoader`` / ``DatasetIterator``, a torch ``DataLoader``, a
  ``tf.data.Dataset``. The pipeline batches and shuffles; with several processes each
  process's pipeline yields its own part of every global batch. An iterator with grain's
  ``get_state()`` / ``set_state()`` is saved in trainkit's checkpoints and resumed without
  replaying; any other one is resumed by skipping the batches already trained.

>>> import numpy as np
>>> rows = [(np.full(2, i, np.float32), i) for i in range(5)]  # any len() + [i] collection
>>> source = RandomAccessSource(rows)
>>> [b["y"].tolist() for b in source.batches(2)]
[[0, 1], [2, 3], [4, 0]]
>>> isinstance(source, DataSource)
True
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from trainkit import checks
from trainkit import data as data_lib

PyTree = Any
Batch = dict[str, Any]
#: Hugging Face's (and transformers') name of the target column.
LABEL_COLUMNS = ("label", "labels")


@runtime_checkable
class DataSource(Protocol):
    """What the loop reads. ``batches`` yields this process's part of every global batch of
    ``batch_size`` rows, padded to a fixed shape with a row ``mask``, from batch ``start`` of
    epoch ``epoch`` on (or, for a checkpointable iterator, from the saved ``state``; see
    ``get_state``). ``steps`` is the number of batches per pass when known, ``element_spec``
    the per-example input shapes and dtypes, ``first(rows)`` the first rows as ``(x, y, w)``.

    Optional: ``one_shot`` (a consumed iterator that continues across epochs),
    ``checkpointable`` and ``get_state()`` (the reader's position after the last batch read,
    JSON-serialisable, saved by ``BackupAndRestore``).
    """

    has_targets: bool

    def element_spec(self) -> PyTree: ...

    def first(self, rows: int = 1) -> tuple[PyTree, PyTree, PyTree]: ...

    def steps(self, batch_size: int) -> int | None: ...

    def batches(self, batch_size: int, **options: Any) -> Iterator[Batch]: ...


def _pick(tree: dict, columns: str | Sequence[str] | None, what: str) -> PyTree:
    if columns is None:
        return None
    names = [columns] if isinstance(columns, str) else list(columns)
    missing = [name for name in names if name not in tree]
    if missing:
        raise ValueError(
            f"The {what} column(s) {missing} are not in the data, whose columns are {sorted(tree)}. "
            f"Name existing columns in {what}=."
        )
    return tree[columns] if isinstance(columns, str) else {name: tree[name] for name in names}


_WORKER_SOURCE: RandomAccessSource | None = None  # the source a worker process reads


def _start_worker(source: RandomAccessSource) -> None:
    global _WORKER_SOURCE
    _WORKER_SOURCE = source


def _read_in_worker(rows: np.ndarray) -> tuple[PyTree, PyTree, PyTree]:
    return _WORKER_SOURCE._read(rows)  # type: ignore[union-attr]


def _stack(elements: list) -> PyTree:
    return jax.tree.map(lambda *leaves: np.stack([data_lib.host_array(a) for a in leaves]), *elements)


class RandomAccessSource:
    """Any collection with ``len()`` and ``[index]`` whose elements are examples: ``(x, y)``
    or ``(x, y, sample_weight)`` tuples, a bare ``x``, or dicts of columns. Batched, shuffled
    and split across processes exactly as arrays are (:func:`trainkit.data.batch_rows`).

    Args:
        source: grain ``MapDataset``, Hugging Face ``Dataset``, torch map-style ``Dataset``,
            or any sequence of examples.
        x, y, sample_weight: for dict elements (columns), the column (a name: one array) or
            columns (a list: a dict of arrays) of each part. Without them a tuple element is
            ``(x, y[, sample_weight])`` and a dict element is ``x`` (Keras's rule).
        workers: worker processes reading whole batches, for decode-heavy sources written in
            Python (the GIL lets one thread decode at a time). The pool starts with the first
            batch (the source must be picklable, and a script needs the ``if __name__ ==
            "__main__":`` guard) and lives as long as the source, across epochs and fits;
            batches keep their order. 0 (the default) reads in trainkit's background thread.

    >>> import numpy as np
    >>> columns = [{"pixels": np.zeros(3), "label": i} for i in range(4)]
    >>> batch = next(RandomAccessSource(columns, x="pixels", y="label").batches(4))
    >>> batch["x"].shape, batch["y"].tolist()
    ((4, 3), [0, 1, 2, 3])
    """

    one_shot = False

    def __init__(
        self,
        source: Any,
        *,
        x: str | Sequence[str] | None = None,
        y: str | Sequence[str] | None = None,
        sample_weight: str | None = None,
        workers: int = 0,
    ):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"workers must be a non-negative integer; received {workers!r}.")
        if x is None and (y is not None or sample_weight is not None):
            raise ValueError("Name the input column(s) with x= when naming y= or sample_weight= columns.")
        self.source, self.columns, self.workers = source, (x, y, sample_weight), workers
        self._pool: Any = None
        self.num_examples = len(source)
        if self.num_examples == 0:
            raise ValueError("The dataset is empty (0 rows); pass at least one example.")
        x0, y0, _ = self._first = self._rows(np.arange(1))
        checks.numeric(x0, "x")
        checks.numeric(y0, "y")

    def _split(self, stacked: PyTree) -> tuple[PyTree, PyTree, PyTree]:
        x, y, w = self.columns
        if x is None:
            return data_lib.split_xyw(stacked)
        if not isinstance(stacked, dict):
            raise ValueError(
                f"x={x!r} names columns, but the dataset's elements are {type(stacked).__name__}s, not dicts."
            )
        return _pick(stacked, x, "x"), _pick(stacked, y, "y"), _pick(stacked, w, "sample_weight")

    def _gather(self, rows: np.ndarray) -> PyTree:
        """The elements at ``rows``, stacked into one tree of arrays."""
        return _stack([self.source[int(i)] for i in rows])

    def _rows(self, rows: np.ndarray) -> tuple[PyTree, PyTree, PyTree]:
        x, y, w = (data_lib.to_host(part) for part in self._split(self._gather(np.asarray(rows))))
        return x, y, w

    @property
    def has_targets(self) -> bool:
        return self._first[1] is not None

    def element_spec(self) -> PyTree:
        return data_lib.example_spec(self._first[0])

    def first(self, rows: int = 1) -> tuple[PyTree, PyTree, PyTree]:
        x, y, _ = self._rows(np.arange(min(rows, self.num_examples)))
        return x, y, None

    def steps(self, batch_size: int) -> int:
        return -(-self.num_examples // batch_size)

    def _read(self, rows: np.ndarray) -> tuple[PyTree, PyTree, PyTree]:
        """The rows' ``(x, y, w)``; zero-row arrays for a process whose part of the last batch
        is empty."""
        if len(rows):
            return self._rows(rows)
        return tuple(None if t is None else jax.tree.map(lambda a: a[:0], t) for t in self._first)  # type: ignore

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pool": None}  # what a worker process receives

    def _worker_pool(self) -> Any:
        if self._pool is None:
            import multiprocessing
            import weakref

            # spawn: JAX's threads make fork unsafe
            context = multiprocessing.get_context("spawn")
            self._pool = context.Pool(self.workers, initializer=_start_worker, initargs=(self,))
            weakref.finalize(self, self._pool.terminate)
        return self._pool

    def close(self) -> None:
        """Stops the worker processes (they also stop with the source or the interpreter)."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None

    def _parts(self, batches_rows: Iterator[np.ndarray]) -> Iterator[tuple[PyTree, PyTree, PyTree]]:
        if not self.workers:
            yield from map(self._read, batches_rows)
            return
        pool, pending = self._worker_pool(), collections.deque()
        for rows in batches_rows:  # at most two batches per worker in flight
            pending.append(pool.apply_async(_read_in_worker, (rows,)))
            if len(pending) >= 2 * self.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

    def batches(
        self,
        batch_size: int,
        *,
        shuffle: bool | str = False,
        seed: int = 0,
        epoch: int = 0,
        start: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        **_: Any,
    ) -> Iterator[Batch]:
        """This process's part of every global batch from batch ``start`` on (see
        :func:`trainkit.data.batch_rows`); the rows before ``start`` are never read."""
        all_rows = data_lib.batch_rows(
            self.num_examples, batch_size, shuffle, seed, epoch, start, process_index, process_count
        )
        index_rows = (np.arange(r.start, r.stop) if isinstance(r, slice) else r for r in all_rows)
        for x, y, w in self._parts(index_rows):
            n = len(jax.tree.leaves(x)[0])
            yield data_lib.pad_batch(
                x, y, None if w is None else checks.sample_weights(w, n), batch_size // process_count
            )


class HuggingFaceSource(RandomAccessSource):
    """A Hugging Face ``datasets.Dataset`` in NumPy format, gathered a batch at a time (one
    Arrow read per batch). Without ``x=``, the ``label`` (or ``labels``) column is the target
    and the other columns are a dict of inputs; name columns to choose otherwise."""

    def __init__(self, dataset: Any, **options: Any):
        dataset = dataset.with_format("numpy")
        if options.get("x") is None and options.get("y") is None:
            label = next((name for name in LABEL_COLUMNS if name in dataset.column_names), None)
            inputs = [name for name in dataset.column_names if name != label]
            options = {**options, "x": inputs, "y": label}
        super().__init__(dataset, **options)

    def _gather(self, rows: np.ndarray) -> PyTree:
        return dict(self.source[rows.tolist()]) if len(rows) else super()._gather(rows)


class _TensorFlowBatches:
    """A ``tf.data.Dataset`` as a re-iterable of NumPy batches (``as_numpy_iterator`` per
    epoch), with its length when tf.data knows it."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __iter__(self) -> Iterator:
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


def _module(name: str) -> Any:
    """A library already imported by the user (an object of its type implies it), else None."""
    return sys.modules.get(name)


def adapt(data: Any) -> Any:
    """The :class:`DataSource` for a data library's dataset, or ``None`` when ``data`` is none of
    them (arrays and plain iterables are handled by :func:`trainkit.data.as_dataset`).

    >>> adapt([1, 2]) is None
    True
    """
    grain = _module("grain")
    if grain is not None:
        if isinstance(data, grain.MapDataset):
            return RandomAccessSource(data)
        if isinstance(data, (grain.IterDataset, grain.DataLoader, grain.DatasetIterator)):
            _absl_flags_parsed()
            return data_lib.IterableDataset(data)
    torch = _module("torch")
    if (
        torch is not None
        and hasattr(torch, "utils")
        and isinstance(data, torch.utils.data.Dataset | torch.utils.data.DataLoader)
    ):
        if isinstance(data, torch.utils.data.DataLoader):
            return data_lib.IterableDataset(data, convert=_listed_batch)
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
        return data_lib.IterableDataset(_TensorFlowBatches(data))
    return None
