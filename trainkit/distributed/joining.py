"""Joining a multi-process job fails fast and says why: the coordinator's address is resolved
before anything waits, process 0 checks that its port is free, and a bound (``JOIN_TIMEOUT``
seconds, ``TRAINKIT_JOIN_TIMEOUT`` to change it) ends a process whose peers never come with
trainkit's own line naming the coordinator, this process's index, the count and what did not
answer, where JAX alone would wait 300 s and abort with a C++ log that blames "another task".

>>> resolved("localhost:1234")
('localhost', 1234)
>>> resolved("no-such-host.invalid:1234")
Traceback (most recent call last):
...
RuntimeError: trainkit: the coordinator address 'no-such-host.invalid:1234' does not resolve ...
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from collections.abc import Iterator

from trainkit.distributed import environment

#: Seconds a process waits for every process of its job to connect before it ends, naming what
#: did not answer (``TRAINKIT_JOIN_TIMEOUT`` overrides it; ``initialize(initialization_timeout=)`` too).
JOIN_TIMEOUT = 120.0
#: the exit status of a process whose peers never came
JOIN_FAILED = 3


def join_timeout(given: float | None = None) -> float:
    """The bound in force: ``given``, else ``TRAINKIT_JOIN_TIMEOUT``, else ``JOIN_TIMEOUT``."""
    return float(given) if given is not None else environment.seconds("TRAINKIT_JOIN_TIMEOUT", JOIN_TIMEOUT)


def shown(address: str) -> str:
    """``address`` as messages print it: a user-info part (``user:password@``, a mistake in a
    coordinator address) masked.

    >>> shown("alice:s3cr3t@node0:1234"), shown("node0:1234")
    ('***@node0:1234', 'node0:1234')
    """
    return "***@" + address.rpartition("@")[2] if "@" in address else address


def resolved(address: str) -> tuple[str, int]:
    """``(host, port)`` of a ``host:port`` coordinator address, checked to resolve (no wait on a
    name that never will)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise RuntimeError(
            f"trainkit: the coordinator address {shown(address)!r} is not host:port (e.g. 'node0:1234'): set "
            "JAX_COORDINATOR_ADDRESS (or the engine's variables) to one."
        )
    try:
        socket.getaddrinfo(host, int(port))
    except (socket.gaierror, UnicodeError) as error:
        raise RuntimeError(
            f"trainkit: the coordinator address {shown(address)!r} does not resolve ({error}): no process could reach "
            "it. Check the host name the launcher set (JAX_COORDINATOR_ADDRESS, MASTER_ADDR, the first node of the "
            "SLURM step)."
        ) from None
    return host, int(port)


def check_port_free(address: str) -> None:
    """On process 0, which hosts the coordinator: its port is free (another program holding it
    would make every process wait for a service that never starts)."""
    host, port = resolved(address)
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as error:
            raise RuntimeError(
                f"trainkit: process 0 hosts the job's coordinator on port {port} ({address}), but that port is in "
                f"use ({error.strerror}): another process 0 of this job (an index given twice: each process needs its "
                "own RANK / SLURM_PROCID / OMPI_COMM_WORLD_RANK, 0 to N-1), another program, or an earlier run still "
                "alive. Give each process its own index, pick another port (JAX_COORDINATOR_ADDRESS=host:port, or "
                "JAX_COORDINATOR_PORT under SLURM and Open MPI), or end that program."
            ) from None


def _unanswered(index: int, count: int, address: str) -> str:
    if index == 0:
        return (
            f"process 0 hosts the coordinator at {address}, and not all of the {count} processes connected to it: "
            f"the others did not start, started in another job, cannot reach {address}, or two of them were given one "
            "index (the second one's connection is refused)"
        )
    return (
        f"process {index} could not complete its connection to the coordinator at {address}: process 0 (which "
        f"hosts it) did not start or cannot be reached from here, not every one of the {count} processes connected, "
        f"or another process was given index {index} too"
    )


@contextlib.contextmanager
def bounded(address: str, index: int, count: int, engine: str, seconds: float) -> Iterator[None]:
    """The block (``jax.distributed.initialize``) bounded by ``seconds``: past it, trainkit's line
    on stderr and the process ends (status ``JOIN_FAILED``), before JAX's own timeout aborts it."""

    def give_up() -> None:
        sys.stderr.write(
            f"trainkit: this process ({index} of {count}, {engine}) waited {seconds:g} s to join the job and gave up: "
            f"{_unanswered(index, count, address)}. Start every process of the job (each with its own index), or "
            "raise the bound with TRAINKIT_JOIN_TIMEOUT (seconds).\n"
        )
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(JOIN_FAILED)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
