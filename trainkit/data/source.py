"""The ``DataSource`` protocol: what the loop reads.

>>> import numpy as np
>>> from trainkit.data.arrays import ArrayDataset
>>> isinstance(ArrayDataset(np.zeros((4, 2))), DataSource)
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TypeAlias, runtime_checkable

import numpy as np

from trainkit.core.tree import JSON, Leaf, PyTree
from trainkit.data.spans import IndexedSpan, Rows

Batch = dict[str, PyTree]


#: What ``fit`` / ``evaluate`` / ``predict`` (and ``init``, ``plan``, ``summary``) take as ``x``, as Keras's do:
#: arrays, or a dict / tuple / list of them (``(x, y)``, ``(x, y, sample_weight)``), their shapes
#: (``jax.ShapeDtypeStruct``), a :class:`DataSource`, or an iterable of batches (a ``tf.data``, grain,
#: torch or Hugging Face dataset, a generator); ``None`` where ``y`` carries the data.
DataInput: TypeAlias = "Leaf | Iterable[object] | Source | DataSource | None"


@dataclasses.dataclass(frozen=True)
class BatchRequest:
    """Which batches a reader asks a :class:`Source` for: those of pass ``epoch`` from batch
    ``start`` on (or, for a checkpointable iterator, from its saved ``state``), in the order
    ``shuffle`` and ``seed`` give, as process ``process_index`` of ``process_count`` reads its
    part of each global batch. ``split``: a larger batch of an iterable is cut into pieces
    (evaluate, predict) instead of refused; ``read_ahead``: a one-shot iterator is read ahead in a
    thread; ``read_limit``: at most this many of its elements (what the caller will take).

    >>> BatchRequest(epoch=2, shuffle=True).keywords()["epoch"]
    2
    """

    epoch: int = 0
    start: int = 0
    shuffle: bool | str = False
    seed: int = 0
    split: bool = False
    state: JSON = None
    read_ahead: bool = True
    read_limit: int | None = None
    process_index: int = 0
    process_count: int = 1

    def keywords(self) -> dict[str, Any]:
        """The request as the keyword arguments a user's :class:`DataSource` takes."""
        return dataclasses.asdict(self)


#: The first pass, in order, read by one process: what ``batches(batch_size)`` reads.
FIRST_PASS = BatchRequest()


@runtime_checkable
class DataSource(Protocol):
    """What the loop reads. ``batches`` yields this process's part of every global batch of
    ``batch_size`` rows, padded to a fixed shape with a row ``mask``, from batch ``start`` of
    epoch ``epoch`` on (or, for a checkpointable iterator, from the saved ``state``; see
    ``get_state``). ``steps`` is the number of batches per pass when known, ``element_spec``
    the per-example input shapes and dtypes, ``first(rows)`` the first rows as ``(x, y, w)``.
    ``batches`` receives a :class:`BatchRequest`'s fields as keywords (``epoch``, ``start``,
    ``shuffle``, ``seed``, ``split``, ``state``, ``read_ahead``, ``read_limit``,
    ``process_index``, ``process_count``); it may ignore those it has no use for.

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
      JSON-serialisable, saved by ``BackupAndRestore`` and passed back as ``BatchRequest(state=...)``.
    - ``num_examples``: the rows of one pass when known without reading them, else ``None``.
    - ``assembles_quickly(batch_size)``: a batch costs less to assemble in the loop's thread
      than to hand over from a background thread (small in-memory arrays), so the loop reads
      it there.
    - ``gathers_rows``: the batches can be named by their rows (``rows``, yielding
      :class:`~trainkit.data.spans.Rows`) and gathered later, one batch (``gather``), the
      stacked batches of a fused call in one piece (``gather_stacked``), or by the devices
      from the rows kept there (``table``, ``indexed_stacked``, ``gather_indices``): in-memory arrays.
    """

    one_shot: bool = False
    gathers_rows: bool = False
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

    def batches(self, batch_size: int, request: BatchRequest = FIRST_PASS) -> Iterator[Batch]:
        """This process's part of every global batch ``request`` asks for (see :class:`BatchRequest`)."""
        raise NotImplementedError

    def get_state(self) -> JSON:
        return None

    def rows(self, batch_size: int, request: BatchRequest = FIRST_PASS) -> Iterator[Rows]:
        """:meth:`batches` named by their rows (a source that ``gathers_rows``)."""
        raise NotImplementedError(f"{type(self).__name__} does not gather rows (gathers_rows is False)")

    def gather(self, rows: Rows) -> Batch:
        raise NotImplementedError(f"{type(self).__name__} does not gather rows (gathers_rows is False)")

    def gather_stacked(self, span: list[Rows]) -> Batch:
        raise NotImplementedError(f"{type(self).__name__} does not gather rows (gathers_rows is False)")

    def gather_indices(self, indices: np.ndarray, mask: np.ndarray) -> Batch:
        raise NotImplementedError(f"{type(self).__name__} does not gather rows (gathers_rows is False)")

    def indexed_stacked(self, span: list[Rows]) -> IndexedSpan | Batch:
        raise NotImplementedError(f"{type(self).__name__} does not gather rows (gathers_rows is False)")

    def table(self) -> Batch:
        raise NotImplementedError(f"{type(self).__name__} does not gather rows (gathers_rows is False)")


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

    def batches(self, batch_size: int, request: BatchRequest = FIRST_PASS) -> Iterator[Batch]:
        return self.source.batches(batch_size, **request.keywords())  # a user's source takes keywords

    def get_state(self) -> JSON:
        return self._get_state() if self.checkpointable and self._get_state is not None else None
