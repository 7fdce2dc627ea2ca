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
import re
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar, cast

T = TypeVar("T")

_END = object()


#: what a source tied to the thread that made it says when read in another (sqlite3's "objects
#: created in a thread can only be used in that same thread", database clients' "another thread")
THREAD_TIED = re.compile(r"created in a thread|(same|another|different|other|owning) thread", re.IGNORECASE)


class _Raised:
    """An error of the reading thread, raised by the consumer in order; one that says the data
    is tied to the thread that made it (sqlite's "objects created in a thread can only be used in
    that same thread") names the fix."""

    def __init__(self, error: BaseException):
        self.error = error
        if isinstance(error, Exception) and THREAD_TIED.search(str(error)):
            self.error = RuntimeError(
                f"Reading the data failed in trainkit's read-ahead thread ({type(error).__name__}: {error}). The "
                "data is read ahead in a background thread by default; a source tied to the thread that made it (an "
                "sqlite3 connection, some database cursors) must be read in yours: pass read_ahead=False to fit."
            )
            self.error.__cause__ = error


def _delivered(item: object, items: queue.Queue[object]) -> object:
    """A queued item as the consumer gets it: the end (``StopIteration``, and every later call
    ends too), the reader's error raised in order, or the item."""
    if item is _END:
        items.put(_END)
        raise StopIteration
    if isinstance(item, _Raised):
        items.put(_END)
        raise item.error
    return item


class Prefetcher(Generic[T]):
    """Iterates ``iterator`` in a daemon thread, ``depth`` items ahead. ``depth=0`` reads in
    the caller's thread, item by item (for one-shot iterators, whose items read ahead would be
    lost at a stop). An error of the iterator is raised by ``next`` in order, after the items
    before it. ``close()`` (or leaving the ``with`` block) stops the thread."""

    def __init__(self, iterator: Iterator[T], depth: int = 4):
        self.iterator, self.depth = iterator, depth
        self._stop = threading.Event()
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max(depth, 1))
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._thread = threading.Thread(target=self._fill, name="trainkit-prefetch", daemon=True)
            self._thread.start()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _read(self) -> T:
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

    def __iter__(self) -> Iterator[T]:
        """The items: with ``depth=0`` the iterator itself (nothing between the caller and it)."""
        return self if self._thread is not None else self.iterator

    def __next__(self) -> T:
        if self._thread is None:
            return self._read()
        return cast(T, _delivered(self._queue.get(), self._queue))  # an item, else it raised

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

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ReadAhead(Generic[T]):
    """Reads a one-shot ``iterator`` (a user's generator) ``depth`` elements ahead in a daemon
    thread, and hands back what it read but nobody took: :meth:`stop` appends the queued
    elements, and the element being read, to ``handed_back`` in order (the caller serves them
    first the next time it iterates), so a stop loses nothing and a jittery loader's waits
    overlap the training. :meth:`join` waits until the element being read is handed back.
    ``keep(element)`` is what is queued of each element, taken as soon as it is read (a copy,
    for an iterator that refills one buffer and yields it again); ``limit``: read no more than
    that many (the consumer's need: what is read ahead beyond it is the iterator's still).

    >>> handed_back = []
    >>> reader = ReadAhead(iter(range(10)), depth=3, handed_back=handed_back)
    >>> next(reader), next(reader)
    (0, 1)
    >>> reader.stop(); reader.join(); handed_back[:2]
    [2, 3]
    """

    def __init__(
        self,
        iterator: Iterator[T],
        depth: int,
        handed_back: list[T],
        keep: Callable[[T], T] | None = None,
        limit: int | None = None,
    ):
        self.iterator: Iterator[T] | None = iterator
        self.handed_back = handed_back
        self.limit = limit  # at most this many elements read (then it ends, as the iterator would)
        #: what is kept of an element when it is read: a copy of buffers the iterator refills in place
        self.keep = keep or (lambda element: element)
        self._stopped = False
        self._lock = threading.Lock()  # the queue and the hand-back change together
        self._slots = threading.Semaphore(max(depth, 1))
        self._queue: queue.Queue[object] = queue.Queue()
        self._thread = threading.Thread(target=self._fill, name="trainkit-read-ahead", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:
            self._read_all()
        finally:
            self.iterator = None  # the iterator's backlog may outlive this reader, not keep it alive

    def _read_all(self) -> None:
        iterator = self.iterator
        assert iterator is not None  # dropped only once reading ends
        read = 0
        while True:
            if self.limit is not None and read >= self.limit:
                self._queue.put(_END)
                return
            read += 1
            while not self._slots.acquire(timeout=0.05):
                if self._stopped:
                    return
            item: object
            try:
                item = self.keep(next(iterator))
            except StopIteration:
                item = _END
            except BaseException as error:  # noqa: BLE001 - raised by the consumer, in order
                item = _Raised(error)
            with self._lock:
                if self._stopped:  # read after the stop: handed back after the queued ones
                    if item is not _END and not isinstance(item, _Raised):
                        self.handed_back.append(cast(T, item))  # an element: neither the end nor an error
                    return
                self._queue.put(item)
            if item is _END or isinstance(item, _Raised):
                return

    def __iter__(self) -> ReadAhead[T]:
        return self

    def __next__(self) -> T:
        item = self._queue.get()
        self._slots.release()
        return cast(T, _delivered(item, self._queue))  # an item, else it raised

    def stop(self) -> None:
        """No more reads; the queued elements are handed back (the one being read follows)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _END and not isinstance(item, _Raised):
                    self.handed_back.append(cast(T, item))  # an element: neither the end nor an error

    def join(self) -> None:
        self._thread.join()
