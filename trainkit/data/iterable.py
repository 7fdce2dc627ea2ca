"""``IterableDataset``: any iterable of batches (a generator, a list, a data loader).

>>> import numpy as np
>>> data = IterableDataset([(np.ones((4, 2)), np.zeros(4)), (np.ones((1, 2)), np.zeros(1))])
>>> data.batch_size, [int(b["mask"].sum()) for b in data.batches()]
(4, [4, 1])
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from trainkit.core import checks
from trainkit.data.batching import Batch, PyTree, check_lengths, example_spec, pad_batch, split_xyw, take, to_host
from trainkit.data.source import Source


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

    def __init__(self, iterable: Iterable, convert: Callable[[Any], Any] | None = None):
        self.iterable = iterable
        self.convert = convert or (lambda element: element)
        self.one_shot = iter(iterable) is iterable
        self._iterator = self._current = iter(iterable)
        self._peeked: list = []
        first = self._peek()
        if first is None:
            raise ValueError("The dataset is empty: its iterable yielded no batch.")
        x, y, w = self._split(first)
        self.batch_size = check_lengths({"x": x, "y": y, "sample_weight": w})
        checks.numeric(x, "x")
        checks.numeric(y, "y")
        self._first = (x, y, w)

    def _split(self, element: Any) -> tuple[PyTree, PyTree, PyTree]:
        return tuple(map(to_host, split_xyw(self.convert(element))))  # type: ignore[return-value]

    def _peek(self):
        if not self._peeked:
            try:
                self._peeked.append(next(self._iterator))
            except StopIteration:
                return None
        return self._peeked[0]

    @property
    def has_targets(self) -> bool:
        return self._first[1] is not None

    @property
    def checkpointable(self) -> bool:
        """Whether the iterator saves and restores its own position (grain's iterators)."""
        return hasattr(self._current, "get_state") and hasattr(self._current, "set_state")

    def get_state(self) -> Any:
        """The iterator's position after the last batch read, JSON-serialisable (grain's
        ``DataLoader`` gives bytes: kept as text); ``None`` when it has none."""
        if not self.checkpointable:
            return None
        state = self._current.get_state()
        return {"bytes": state.decode("latin-1")} if isinstance(state, bytes) else state

    def element_spec(self) -> PyTree:
        return example_spec(self._first[0])

    def first(self, rows: int = 1) -> tuple[PyTree, PyTree, PyTree]:
        x, y, _ = self._first
        return take(x, slice(0, rows)), None if y is None else take(y, slice(0, rows)), None

    def steps(self, batch_size: int | None = None) -> int | None:
        try:
            return len(self.iterable)  # type: ignore[arg-type]
        except TypeError:
            return None

    def _elements(self, start: int, state: Any) -> Iterator:
        # Plain for-loops, not ``yield from``: closing this generator at an epoch's end must
        # not close a one-shot iterator that the next epoch continues.
        if state is not None and self.checkpointable:  # continue where the saved iterator stood
            if not self.one_shot:
                self._current = iter(self.iterable)
            self._peeked.clear()
            as_bytes = isinstance(state, dict) and set(state) == {"bytes"}  # see get_state
            self._current.set_state(state["bytes"].encode("latin-1") if as_bytes else state)
            source = self._current
        else:
            if self._peeked:  # the batch read to learn the shapes comes first
                self._current = self._iterator
                source = itertools.chain([self._peeked.pop()], self._iterator)
            else:
                self._current = source = self._iterator if self.one_shot else iter(self.iterable)
            source = itertools.islice(source, start, None)
        for element in source:  # noqa: UP028
            yield element

    def batches(
        self, batch_size: int | None = None, *, start: int = 0, split: bool = False, state: Any = None, **_: Any
    ) -> Iterator[Batch]:
        """The iterable's batches from batch ``start`` on (or from a saved iterator ``state``),
        padded to the first batch's size. With several processes, each process's iterable
        yields that process's part of every global batch. A larger batch than the first is an
        error in training (it would change what a step averages); with ``split`` (evaluate,
        predict: per-row results) it is cut into pieces of that size."""
        first_spec = example_spec((self._first[0], self._first[1]))
        for index, element in enumerate(self._elements(start, state), start):
            x, y, w = self._split(element)
            n = check_lengths({"x": x, "y": y, "sample_weight": w})
            spec = example_spec((x, y))
            if spec != first_spec:
                raise ValueError(
                    f"Batch {index} of the iterable has (x, y) of per-example shapes and dtypes {spec}, "
                    f"but its first batch had {first_spec}. Every batch must have the same feature shapes (only the "
                    "number of rows may differ); pad or crop the features before batching."
                )
            w = checks.sample_weights(w, n, f"sample_weight of batch {index}")
            if n > self.batch_size and not split:
                raise ValueError(
                    f"A batch of {n} rows follows a first batch of {self.batch_size} rows. "
                    "Every batch of an iterable given to fit must have at most the first batch's size "
                    "(only a smaller, last batch is padded); evaluate and predict split larger ones."
                )
            for lo in range(0, n, self.batch_size):
                part = slice(lo, lo + self.batch_size)
                x_, y_, w_ = (None if t is None else take(t, part) for t in (x, y, w))
                yield pad_batch(x_, y_, w_, self.batch_size)
