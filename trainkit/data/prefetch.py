"""Background prefetch: host batches assembled ahead, off the main thread, in a bounded queue.

The data's reading, decoding, padding and checks run in one background thread while the main
thread dispatches steps; a loader whose time per batch jitters is smoothed by the queue. (The
loop's training reader yields each batch with the source's checkpointable position read in
this same thread right after it, so a checkpoint written while later batches wait in the
queue still names the batch trained last.)

>>> with Prefetcher(iter(range(3)), depth=2) as items:
...     list(items)
[0, 1, 2]
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

_END = object()


class _Raised:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher:
    """Iterates ``iterator`` in a daemon thread, ``depth`` items ahead. ``depth=0`` reads in
    the caller's thread, item by item (for one-shot iterators, whose items read ahead would be
    lost at a stop). An error of the iterator is raised by ``next`` in order, after the items
    before it. ``close()`` (or leaving the ``with`` block) stops the thread."""

    def __init__(self, iterator: Iterator, depth: int = 4):
        self.iterator, self.depth = iterator, depth
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._thread = threading.Thread(target=self._fill, name="trainkit-prefetch", daemon=True)
            self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _read(self) -> Any:
        return next(self.iterator)

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    item = self._read()
                except StopIteration:
                    break
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(_Raised(error))

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._thread is None:
            return self._read()
        item = self._queue.get()
        if item is _END:
            self._queue.put(_END)  # later calls end too
            raise StopIteration
        if isinstance(item, _Raised):
            self._queue.put(_END)
            raise item.error
        return item

    def close(self) -> None:
        """Stops the thread (it finishes the read in progress) and drops queued items."""
        self._stop.set()
        if self._thread is None:
            return
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5.0)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
