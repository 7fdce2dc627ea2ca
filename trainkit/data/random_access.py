"""``RandomAccessSource``: any collection with ``len()`` and ``[index]`` (grain's ``MapDataset``,
a Hugging Face or torch map-style dataset), batched, shuffled and split across processes
exactly as arrays are, optionally read by worker processes.

>>> import numpy as np
>>> rows = [(np.full(2, i, np.float32), i) for i in range(5)]  # any len() + [i] collection
>>> source = RandomAccessSource(rows)
>>> [(b["y"].tolist(), b["mask"].tolist()) for b in source.batches(2)]  # the last batch padded (masked)
[([0, 1], [1.0, 1.0]), ([2, 3], [1.0, 1.0]), ([4, 4], [1.0, 0.0])]
"""

from __future__ import annotations

import collections
import concurrent.futures
import multiprocessing
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from trainkit.core import checks
from trainkit.core.tree import PyTree
from trainkit.data.batching import batch_rows, example_spec, host_array, pad_batch, split_xyw, to_host
from trainkit.data.source import FIRST_PASS, BatchRequest, Source

Batch = dict[str, Any]
#: Hugging Face's (and transformers') name of the target column.
LABEL_COLUMNS = ("label", "labels")


def _pick(tree: dict[str, PyTree], columns: str | Sequence[str] | None, what: str) -> PyTree:
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
    if _WORKER_SOURCE is None:
        raise RuntimeError("a trainkit reader process started without its source (_start_worker runs first)")
    return _WORKER_SOURCE._read(rows)


def _stop_pool(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Stops an executor's worker processes without waiting for the batches they are reading."""
    processes = list((pool._processes or {}).values())  # CPython's ProcessPoolExecutor keeps them there
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()


def _dead_workers(processes: Iterable[multiprocessing.Process]) -> str:
    """Which worker processes ended, and how (``pid 123 killed by SIGKILL``)."""
    import signal

    ended = []
    for process in processes:
        # A killed worker may not be reaped yet. When the executor's thread reaps it first, join
        # returns at once and its status appears a moment later: wait for it, 2 s at most.
        deadline = time.monotonic() + 2.0
        while process.exitcode is None and time.monotonic() < deadline:
            process.join(0.01)
        code = process.exitcode
        if code is None and not process.is_alive():
            ended.append(f"pid {process.pid} ended")
        elif code is not None and code != 0:
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            ended.append(f"pid {process.pid} {how}")
    ended.sort(key=lambda text: text.endswith("SIGTERM"))  # the executor stops the others with SIGTERM
    return ", ".join(ended) or "it ended without an exit status"


def _stack(elements: list[PyTree]) -> PyTree:
    return jax.tree.map(lambda *leaves: np.stack([host_array(a) for a in leaves]), *elements)


class RandomAccessSource(Source):
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
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self.num_examples: int = len(source)
        if self.num_examples == 0:
            raise ValueError("The dataset is empty (0 rows); pass at least one example.")
        x0, y0, _ = self._first = self._rows(np.arange(1))
        checks.numeric(x0, "x")
        checks.numeric(y0, "y")

    def _split(self, stacked: PyTree) -> tuple[PyTree, PyTree, PyTree]:
        x, y, w = self.columns
        if x is None:
            return split_xyw(stacked)
        if not isinstance(stacked, dict):
            raise ValueError(
                f"x={x!r} names columns, but the dataset's elements are {type(stacked).__name__}s, not dicts."
            )
        return _pick(stacked, x, "x"), _pick(stacked, y, "y"), _pick(stacked, w, "sample_weight")

    def _gather(self, rows: np.ndarray) -> PyTree:
        """The elements at ``rows``, stacked into one tree of arrays."""
        return _stack([self.source[int(i)] for i in rows])

    def _rows(self, rows: np.ndarray) -> tuple[PyTree, PyTree, PyTree]:
        x, y, w = (to_host(part) for part in self._split(self._gather(np.asarray(rows))))
        return x, y, w

    @property
    def has_targets(self) -> bool:
        return self._first[1] is not None

    def element_spec(self) -> PyTree:
        return example_spec(self._first[0])

    def first(self, rows: int = 1) -> tuple[PyTree, PyTree, PyTree]:
        return self._rows(np.arange(min(rows, self.num_examples)))

    def steps(self, batch_size: int) -> int:
        return -(-self.num_examples // batch_size)

    def _read(self, rows: np.ndarray) -> tuple[PyTree, PyTree, PyTree]:
        """The rows' ``(x, y, w)``; zero-row arrays for a process whose part of the last batch
        is empty."""
        if len(rows):
            return self._rows(rows)
        x, y, w = (None if t is None else jax.tree.map(lambda a: a[:0], t) for t in self._first)
        return x, y, w

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_pool": None}  # what a worker process receives

    def _worker_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            import concurrent.futures
            import multiprocessing
            import pickle
            import weakref

            try:
                pickle.dumps(self)
            except Exception as error:  # noqa: BLE001 - pickle raises many kinds
                raise ValueError(
                    f"RandomAccessSource(workers={self.workers}) sends the source to each worker process, but it "
                    f"cannot be pickled ({type(error).__name__}: {error}). Make it picklable (module-level classes "
                    "and functions, no open files or locks; reopen them in __getstate__/__setstate__), or pass "
                    "workers=0 to read it in trainkit's thread."
                ) from error
            # spawn: JAX's threads make fork unsafe. An executor, not a Pool: a worker that dies
            # (the OOM killer) breaks its futures at once, where a Pool's task waits forever.
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
                initargs=(self,),
            )
            weakref.finalize(self, _stop_pool, self._pool)
        return self._pool

    def close(self) -> None:
        """Stops the worker processes (they also stop with the source or the interpreter)."""
        if self._pool is not None:
            _stop_pool(self._pool)
            self._pool = None

    def _parts(self, batches_rows: Iterator[np.ndarray]) -> Iterator[tuple[PyTree, PyTree, PyTree]]:
        if not self.workers:
            yield from map(self._read, batches_rows)
            return
        import concurrent.futures.process

        pool, pending = (
            self._worker_pool(),
            collections.deque[concurrent.futures.Future[tuple[PyTree, PyTree, PyTree]]](),
        )
        workers: dict[
            int, multiprocessing.Process
        ] = {}  # pid -> process, kept: a broken executor forgets its dead workers
        try:
            for rows in batches_rows:  # at most two batches per worker in flight
                pending.append(pool.submit(_read_in_worker, rows))
                workers.update(pool._processes or {})  # CPython's ProcessPoolExecutor keeps them there
                if len(pending) >= 2 * self.workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except concurrent.futures.process.BrokenProcessPool as error:
            dead = _dead_workers(workers.values())
            self.close()  # a later epoch or fit starts new workers
            raise RuntimeError(
                f"A data worker process of RandomAccessSource(workers={self.workers}) died ({dead}), so the "
                "batches it was reading are lost; the training state is that of the last step trained. "
                "A worker killed by SIGKILL is usually the out-of-memory killer: use fewer workers or smaller "
                "batches, then fit again (BackupAndRestore resumes where this run stopped)."
            ) from error
        finally:
            for future in pending:
                future.cancel()

    def batches(self, batch_size: int, request: BatchRequest = FIRST_PASS) -> Iterator[Batch]:
        """This process's part of every global batch from batch ``request.start`` on (see
        :func:`trainkit.data.batch_rows`); the rows before ``start`` are never read. A source
        whose length changed since it was wrapped (files re-created) is refused, naming both
        lengths: its epochs, positions and shuffles were fixed by the first one."""
        now = len(self.source)
        if now != self.num_examples:
            raise ValueError(
                f"The data source had {self.num_examples} rows when fit started and has {now} now: its epochs, "
                "positions and shuffle order were fixed by the first length, so rows would be skipped or read "
                "out of range. Wrap the changed data anew (pass it to the next fit) once it stops changing."
            )
        r = request
        all_rows = batch_rows(
            self.num_examples, batch_size, r.shuffle, r.seed, r.epoch, r.start, r.process_index, r.process_count
        )
        index_rows = (np.arange(r.start, r.stop) if isinstance(r, slice) else r for r in all_rows)
        for x, y, w in self._parts(index_rows):
            n = len(jax.tree.leaves(x)[0])
            yield pad_batch(x, y, None if w is None else checks.sample_weights(w, n), batch_size // r.process_count)


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
