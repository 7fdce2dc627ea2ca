"""The ``DataSource`` protocol: what the loop reads.

>>> import numpy as np
>>> from trainkit.data.arrays import ArrayDataset
>>> isinstance(ArrayDataset(np.zeros((4, 2))), DataSource)
True
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

PyTree = Any
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
