"""``IterableDataset``: any iterable of batches (a generator, a list, a data loader).

>>> import numpy as np
>>> data = IterableDataset([(np.ones((4, 2)), np.zeros(4)), (np.ones((1, 2)), np.zeros(1))])
>>> data.batch_size, [int(b["mask"].sum()) for b in data.batches()]
(4, [4, 1])
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any

import jax
import numpy as np

from trainkit.core import checks
from trainkit.core.tree import JSON
from trainkit.data.batching import Batch, PyTree, check_lengths, example_spec, pad_batch, split_xyw, take, to_host
from trainkit.data.prefetch import ReadAhead
from trainkit.data.source import FIRST_PASS, BatchRequest, Source

#: Elements of a one-shot iterator read ahead in a background thread.
READ_AHEAD = 8


@dataclasses.dataclass
class Backlog:
    """What was read from an iterator and not trained on (``elements``, in order), and the
    thread reading it ahead (``reader``). ``shared``: kept with the iterator itself."""

    elements: list[object] = dataclasses.field(default_factory=list)
    reader: ReadAhead[object] | None = None
    shared: bool = False


_BACKLOGS: weakref.WeakKeyDictionary[Iterator[object], Backlog] = weakref.WeakKeyDictionary()
#: the backlogs of iterators that take no weak reference (``iter(list)``, ``map``, ``zip``,
#: ``itertools.islice``), with the iterator itself, the most recently used last
_HELD: collections.OrderedDict[int, tuple[Iterator[object], Backlog]] = collections.OrderedDict()
#: how many such iterators keep their backlog (each is kept alive while it is held)
HELD_ITERATORS = 16


def backlog_of(iterator: Iterator[object]) -> Backlog:
    """The backlog kept with a one-shot ``iterator`` (a generator, ``iter(list)``, ``map``,
    ...), so that every dataset wrapping it serves what an earlier one read (``init``'s shape
    peek, a stop's read-ahead). An iterator that takes no weak reference is held, with its
    backlog, among the last ``HELD_ITERATORS`` such iterators used.

    >>> numbers = map(int, "123")
    >>> backlog_of(numbers).elements.append(1)
    >>> backlog_of(numbers).elements
    [1]
    """
    try:
        return _BACKLOGS.setdefault(iterator, Backlog(shared=True))
    except TypeError:
        pass
    held = _HELD.pop(id(iterator), None)
    if held is None or held[0] is not iterator:
        held = (iterator, Backlog(shared=True))
    _HELD[id(iterator)] = held
    while len(_HELD) > HELD_ITERATORS:
        _HELD.popitem(last=False)
    return held[1]


def detached(element: PyTree) -> PyTree:
    """``element`` with its NumPy arrays copied: what is kept of an element read before it is
    trained on, since a loader may refill one buffer and yield it again.

    >>> buffer = np.zeros(2)
    >>> kept = detached((buffer, 1)); buffer[:] = 5
    >>> kept[0].tolist()
    [0.0, 0.0]
    """
    return jax.tree.map(lambda leaf: np.array(leaf) if isinstance(leaf, np.ndarray) else leaf, element)


def _check_data_source_repr(state: bytes) -> None:
    """grain's ``DataLoader`` resumes only into a data source whose ``repr`` is the saved one;
    Python's default repr (``<Shards object at 0x7f...>``) differs in every process, so such a
    saved position could never be restored: refused when it is saved."""
    import json
    import re

    try:
        source = json.loads(state).get("data_source")
    except (ValueError, AttributeError):
        return  # not grain's JSON state
    if isinstance(source, str) and re.fullmatch(r"<.* object at 0x[0-9a-fA-F]+>", source):
        raise ValueError(
            f"grain's DataLoader checks its data source by repr() when it resumes, and {source} is Python's default "
            "repr, another in every process: the position saved now could never be restored. Give the data source "
            "class a __repr__ that names its contents (its files, say), so that it is the same in the next run."
        )


class IterableDataset(Source):
    """Any iterable of batches; its first batch fixes the static batch size.

    A re-iterable (a list, or an object whose ``__iter__`` returns a fresh iterator) restarts
    every epoch; a one-shot iterator (a generator) is consumed across epochs, so give
    ``steps_per_epoch`` with it. An iterator with grain's ``get_state()`` / ``set_state()``
    is checkpointable: :meth:`get_state` is its position after the last batch read, and
    ``batches(state=...)`` continues from such a position without replaying batches.
    ``convert`` turns each element into ``x``, ``(x, y)`` or ``(x, y, sample_weight)``
    (an adapter's rule, such as a torch ``DataLoader``'s lists).
    """

    def __init__(self, iterable: Iterable[object], convert: Callable[[object], PyTree] | None = None):
        self.iterable = iterable
        self.convert = convert or (lambda element: element)
        self.one_shot = iter(iterable) is iterable
        self._iterator = iter(iterable)
        self._current: Any = self._iterator  # grain's iterators also have get_state / set_state
        # elements read but not trained on, served first: a one-shot iterator's are kept with
        # it, so a later fit on the same generator serves them too
        self._backlog = backlog_of(self._iterator) if self.one_shot else Backlog()
        self._peeked = self._backlog.elements
        first = self._peek()
        if first is None:
            raise ValueError("The dataset is empty: its iterable yielded no batch.")
        # copies: the first batch is kept as long as the dataset, and a pipeline's batch may be a view
        # of its buffers (grain's worker processes hand over shared memory, freed when unreferenced)
        x, y, w = (None if part is None else jax.tree.map(np.array, part) for part in self._split(first))
        self.batch_size = check_lengths({"x": x, "y": y, "sample_weight": w})
        checks.numeric(x, "x")
        checks.numeric(y, "y")
        self._first = (x, y, w)

    def _split(self, element: PyTree) -> tuple[PyTree, PyTree, PyTree]:
        x, y, w = split_xyw(self.convert(element))
        return to_host(x), to_host(y), to_host(w)

    def _peek(self):
        self._join_read_ahead()
        if not self._peeked:
            try:
                self._peeked.append(detached(next(self._iterator)))
            except StopIteration:
                return None
        return self._peeked[0]

    @property
    def has_targets(self) -> bool:
        return self._first[1] is not None

    @property
    def checkpointable(self) -> bool:  # type: ignore[override]  # a class attribute on Source
        """Whether the iterator saves and restores its own position (grain's iterators)."""
        return hasattr(self._current, "get_state") and hasattr(self._current, "set_state")

    def get_state(self) -> JSON:
        """The iterator's position after the last batch read, JSON-serialisable (grain's
        ``DataLoader`` gives bytes: kept as text); ``None`` when it has none."""
        if not self.checkpointable:
            return None
        state = self._current.get_state()
        if isinstance(state, bytes):
            _check_data_source_repr(state)
            return {"bytes": state.decode("latin-1")}
        position: JSON = state
        return position

    def element_spec(self) -> PyTree:
        return example_spec(self._first[0])

    def first(self, rows: int = 1) -> tuple[PyTree, PyTree, PyTree]:
        x, y, w = (None if part is None else take(part, slice(0, rows)) for part in self._first)
        return x, y, w

    def steps(self, batch_size: int | None = None) -> int | None:
        try:
            return len(self.iterable) if isinstance(self.iterable, Sized) else None
        except TypeError:  # a __len__ that refuses (a generator-backed object)
            return None

    def _elements(
        self, start: int, state: Any, read_ahead: bool = True, read_limit: int | None = None
    ) -> Iterator[object]:
        # Plain for-loops, not ``yield from``: closing this generator at an epoch's end must
        # not close a one-shot iterator that the next epoch continues.
        if state is not None and self.checkpointable:  # continue where the saved iterator stood
            if not self.one_shot:
                self._current = iter(self.iterable)
            self._peeked.clear()
            as_bytes = isinstance(state, dict) and set(state) == {"bytes"}  # see get_state
            self._current.set_state(state["bytes"].encode("latin-1") if as_bytes else state)
            source = self._current
        elif self.one_shot:
            # Read ahead in a thread; what it read and nobody trained on is handed back to
            # _peeked when this generator closes (an epoch's end, a stop), served first next time.
            self._current = self._iterator
            self._join_read_ahead()  # one reader of the iterator at a time
            # a checkpointable iterator is not read ahead: its position is read per batch
            if read_ahead and self._backlog.shared and not self.checkpointable:
                limit = None if read_limit is None else max(start + read_limit - len(self._peeked), 0)
                reader = ReadAhead(self._iterator, READ_AHEAD, self._peeked, keep=detached, limit=limit)
                self._backlog.reader = reader
                source = itertools.islice(itertools.chain(self._served(), reader), start, None)
                try:
                    for element in source:  # noqa: UP028
                        yield element
                finally:
                    reader.stop()
                return
            source = itertools.islice(itertools.chain(self._served(), self._iterator), start, None)
        else:
            if self._peeked:  # the batch read to learn the shapes comes first
                self._current = self._iterator
                source = itertools.chain([self._peeked.pop()], self._iterator)
            else:
                self._current = source = iter(self.iterable)
            source = itertools.islice(source, start, None)
        for element in source:  # noqa: UP028
            yield element

    def _join_read_ahead(self) -> None:
        """The previous read-ahead stopped, with what it was reading handed back."""
        reader, self._backlog.reader = self._backlog.reader, None
        if reader is not None:
            reader.stop()
            reader.join()

    def _served(self) -> Iterator[object]:
        """The elements read before and not trained on (the shape peek, a stop's read-ahead),
        in order."""
        while self._peeked:
            yield self._peeked.pop(0)

    def batches(self, batch_size: int | None = None, request: BatchRequest = FIRST_PASS) -> Iterator[Batch]:
        """The iterable's batches from batch ``start`` on (or from a saved iterator ``state``),
        padded to the first batch's size; a one-shot iterator's elements read ahead in a thread
        unless not ``read_ahead``, at most ``read_limit`` of them (what the caller will take).
        With several processes, each process's iterable
        yields that process's part of every global batch. A larger batch than the first is an
        error in training (it would change what a step averages); with ``split`` (evaluate,
        predict: per-row results) it is cut into pieces of that size."""
        first_spec = example_spec((self._first[0], self._first[1]))
        r = request
        for index, element in enumerate(self._elements(r.start, r.state, r.read_ahead, r.read_limit), r.start):
            x, y, w = self._split(element)
            empty = (
                f"Batch {index} of the iterable has 0 rows (its first had {self.batch_size}): every batch needs at "
                "least one row. A filter or the last shard of a split may leave a batch empty; drop empty batches "
                "in the pipeline before fit."
            )
            n = check_lengths({"x": x, "y": y, "sample_weight": w}, empty)
            spec = example_spec((x, y))
            if spec != first_spec:
                raise ValueError(
                    f"Batch {index} of the iterable has (x, y) of per-example shapes and dtypes {spec}, "
                    f"but its first batch had {first_spec}. Every batch must have the same feature shapes (only the "
                    "number of rows may differ); pad or crop the features before batching."
                )
            w = checks.sample_weights(w, n, f"sample_weight of batch {index}")
            if n > self.batch_size and not r.split:
                raise ValueError(
                    f"A batch of {n} rows follows a first batch of {self.batch_size} rows. "
                    "Every batch of an iterable given to fit must have at most the first batch's size "
                    "(only a smaller, last batch is padded); evaluate and predict split larger ones."
                )
            for lo in range(0, n, self.batch_size):
                part = slice(lo, lo + self.batch_size)
                x_, y_, w_ = (None if t is None else take(t, part) for t in (x, y, w))
                yield pad_batch(x_, y_, w_, self.batch_size, copy=True)  # out of the pipeline's buffers
