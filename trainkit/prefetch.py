"""Background prefetch: host batches assembled ahead, off the main thread, in a bounded queue.

The data's reading, decoding, padding and checks run in one background thread while the main
thread dispatches steps; a loader whose time per batch jitters is smoothed by the queue. Each
item comes with the source's checkpointable position read right after it (``state``), so a
checkpoint written while later batches wait in the queue still names the batch trained last.

>>> with Prefetcher(iter(range(3)), depth=2, state=lambda: "s") as items:
...     list(items)
[(0, 's'), (1, 's'), (2, 's')]
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

_END = object()


class _Raised:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher:
    """Iterates ``iterator`` in a daemon thread, ``depth`` items ahead; yields
    ``(item, state())`` pairs (``state`` is ``None`` when no callable is given). ``depth=0``
    reads in the caller's thread, item by item (for one-shot iterators, whose items read
    ahead would be lost at a stop). An error of the iterator is raised by ``next`` in order,
    after the items before it. ``close()`` (or leaving the ``with`` block) stops the thread."""

    def __init__(self, iterator: Iterator, depth: int = 4, state: Callable[[], Any] | None = None):
        self.iterator, self.depth, self.state = iterator, depth, state
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
        item = next(self.iterator)
        return item, (self.state() if self.state is not None else None)

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    pair = self._read()
                except StopIteration:
                    break
                if not self._put(pair):
                    return
            self._put(_END)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(_Raised(error))

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> tuple[Any, Any]:
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
