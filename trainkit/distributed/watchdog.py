"""A stalled peer ends a multi-process run with a message naming it.

JAX's heartbeat runs on its own thread, so a process that hangs in Python (a ``sleep`` or a
deadlock in a callback) stays "alive" while the others wait in their next collective forever.
During ``fit`` every process publishes its step to the coordination service's key-value store
(a thread publishes the latest step once a second); it looks when its own steps stop for
``timeout`` seconds. If a peer is behind (a lower step) and has not stepped for as long, the
peer is stalled: the watchdog prints a ``StallError`` line naming it and ends this process
(status 1), which ends the run (``trainkit.launch`` stops the others; without it, the
coordination service does). When every process is at the same step (a long compile, a slow
step), nobody is blamed and nothing happens.

>>> StallWatchdog(timeout=60).active   # one process: nothing to watch
False
"""

from __future__ import annotations

import os
import sys
import threading
import time

import jax

from trainkit.distributed import environment
from trainkit.internals.runtime import distributed_client

#: Seconds without progress before a peer that is behind is declared stalled
#: (``TRAINKIT_STALL_TIMEOUT`` overrides it).
STALL_TIMEOUT = 600.0
_PREFIX = "trainkit/progress/"


class StallWatchdog:
    """Publishes this process's step and watches the others' (see the module docstring)."""

    def __init__(self, timeout: float | None = None):
        self.timeout = environment.seconds("TRAINKIT_STALL_TIMEOUT", timeout or STALL_TIMEOUT)
        self.client = distributed_client() if jax.process_count() > 1 else None  # JAX's coordination client
        self.active = self.client is not None
        self._step, self._moved = -1, time.monotonic()
        self._moved_at = time.time()  # wall-clock time of the last step (what peers compare)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StallWatchdog:
        if self.active:
            self._moved = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="trainkit-stall-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def progress(self, step: int) -> None:
        """Called by the loop after each step it dispatches (no I/O: the watchdog thread
        publishes the latest step once a second)."""
        if self.active:
            self._step, self._moved, self._moved_at = step, time.monotonic(), time.time()

    def _publish(self, step: int) -> None:
        if self.client is None:
            return
        try:
            self.client.key_value_set(
                f"{_PREFIX}{jax.process_index()}", f"{step} {self._moved_at}", allow_overwrite=True
            )
        except Exception:  # noqa: BLE001 - the watchdog must never break training
            pass

    def _watch(self) -> None:
        published = None
        while not self._stop.wait(1.0):
            if self._step != published:  # the latest step, with the wall time it was reached
                published = self._step
                self._publish(published)
            if time.monotonic() - self._moved >= self.timeout:
                stalled = self._stalled_peers()
                if stalled:
                    self._end(stalled)

    def _stalled_peers(self) -> list[tuple[int, int, float]]:
        if self.client is None:
            return []
        try:
            entries = self.client.key_value_dir_get(_PREFIX)
        except Exception:  # noqa: BLE001
            return []
        progress = {}
        for key, value in entries:
            step, wall = value.split()
            progress[int(key.rsplit("/", 1)[1])] = (int(step), float(wall))
        if len(progress) < jax.process_count():
            return []
        ahead = max(step for step, _ in progress.values())
        now = time.time()
        return [
            (index, step, now - wall)
            for index, (step, wall) in sorted(progress.items())
            if step < ahead and now - wall >= self.timeout and index != jax.process_index()
        ]

    def _end(self, stalled: list[tuple[int, int, float]]) -> None:
        names = "; ".join(
            f"process {index} has made no progress for {idle:.0f} s (last at step {step})"
            for index, step, idle in stalled
        )
        print(
            f"trainkit.distributed.watchdog.StallError: {names}, while process {jax.process_index()} reached step "
            f"{self._step}: "
            "it hangs outside the compiled step (Python code, a callback, I/O). Ending the run. "
            "Find where with `py-spy dump --pid <pid>` next time; TRAINKIT_STALL_TIMEOUT sets the wait.",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(1)
