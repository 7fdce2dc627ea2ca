"""The ``DataSource`` protocol: what the loop reads.

>>> import numpy as np
>>> from trainkit.data.arrays import ArrayDataset
>>> isinstance(ArrayDataset(np.zeros((4, 2))), DataSource)
True
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from trainkit.core.tree import JSON, PyTree

Batch = dict[str, Any]


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


class Source:
    """Base class of trainkit's sources: the required members of :class:`DataSource`, and the
    optional ones declared with their defaults, so nothing probes for them.

    - ``one_shot``: a consumed iterator that continues across epochs (cannot restart).
    - ``checkpointable`` / ``get_state()``: the reader's position after the last batch read,
      JSON-serialisable, saved by ``BackupAndRestore`` and passed back as ``batches(state=...)``.
    - ``num_examples``: the rows of one pass when known without reading them, else ``None``.
    - ``assembles_quickly(batch_size)``: a batch costs less to assemble in the loop's thread
      than to hand over from a background thread (small in-memory arrays), so the loop reads
      it there.
    """

    one_shot: bool = False
    checkpointable: bool = False
    num_examples: int | None = None

    def assembles_quickly(self, batch_size: int) -> bool:
        return False

    @property
    def has_targets(self) -> bool:
        raise NotImplementedError

    def element_spec(self) -> PyTree:
        raise NotImplementedError

    def first(self, rows: int = 1) -> tuple[PyTree, PyTree, PyTree]:
        raise NotImplementedError

    def steps(self, batch_size: int) -> int | None:
        raise NotImplementedError

    def batches(self, batch_size: int, **options: Any) -> Iterator[Batch]:
        raise NotImplementedError

    def get_state(self) -> JSON:
        return None


class UserSource(Source):
    """A user's own :class:`DataSource` (any object with its members), with the optional
    members read once from it (``checkpointable``, ``one_shot``, ``get_state``)."""

    def __init__(self, source: DataSource):
        self.source = source
        self.one_shot = bool(getattr(source, "one_shot", False))  # optional members of a user's object
        self.checkpointable = bool(getattr(source, "checkpointable", False))
        self._get_state = getattr(source, "get_state", None)

    @property
    def has_targets(self) -> bool:
        return bool(self.source.has_targets)

    def element_spec(self) -> PyTree:
        return self.source.element_spec()

    def first(self, rows: int = 1) -> tuple[PyTree, PyTree, PyTree]:
        return self.source.first(rows)

    def steps(self, batch_size: int) -> int | None:
        return self.source.steps(batch_size)

    def batches(self, batch_size: int, **options: Any) -> Iterator[Batch]:
        return self.source.batches(batch_size, **options)

    def get_state(self) -> JSON:
        return self._get_state() if self.checkpointable and self._get_state is not None else None
