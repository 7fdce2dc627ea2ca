"""A process whose peers never come ends within the documented bound with trainkit's own line
naming the coordinator, its index, the count and what did not answer (#59); an address that
does not resolve, or a coordinator port another program holds, fails at once."""

import os
import socket
import subprocess
import sys
import time

import pytest

from trainkit.distributed.joining import JOIN_FAILED

BOUND = 2.0  # TRAINKIT_JOIN_TIMEOUT for these runs (seconds)
MARGIN = 45.0  # a loaded CI machine starts Python and JAX slowly: generous, relative to the bound
SCRIPT = "import sys, trainkit.distributed as d; d.initialize(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def join(address: str, count: int, index: int) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "TRAINKIT_JOIN_TIMEOUT": str(BOUND), "JAX_PLATFORMS": "cpu"}
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, address, str(count), str(index)],
        capture_output=True, text=True, env=env, timeout=BOUND + 300 + MARGIN,
    )  # fmt: skip
    return result, time.monotonic() - start


@pytest.mark.parametrize(
    ("index", "says"),
    [
        (1, "process 1 could not complete its connection to the coordinator at 127.0.0.1:{port}: process 0"),
        (0, "process 0 hosts the coordinator at 127.0.0.1:{port}, and not all of the 2 processes connected"),
    ],
    ids=["rank-1-alone", "rank-0-alone"],
)
def test_a_process_whose_peers_never_come_ends_within_the_bound_naming_them(index, says):
    port = free_port()
    result, took = join(f"127.0.0.1:{port}", 2, index)
    assert result.returncode == JOIN_FAILED, result.stderr[-2000:]
    assert f"trainkit: this process ({index} of 2, jax) waited {BOUND:g} s to join the job" in result.stderr
    assert says.format(port=port) in result.stderr and "TRAINKIT_JOIN_TIMEOUT" in result.stderr
    assert BOUND <= took < BOUND + MARGIN  # not JAX's 300 s


def test_an_address_that_does_not_resolve_fails_at_once():
    result, took = join("no-such-host.invalid:1234", 2, 1)
    assert result.returncode == 1 and "the coordinator address 'no-such-host.invalid:1234' does not resolve" in (
        result.stderr
    )


def test_a_coordinator_port_another_program_holds_is_named():
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result, _ = join(f"127.0.0.1:{port}", 2, 0)
    assert result.returncode == 1
    assert f"process 0 hosts the job's coordinator on port {port}" in result.stderr and "in use" in result.stderr


@pytest.mark.parametrize("count", ["0", "-1"])
def test_the_launcher_refuses_a_device_count_below_one_in_one_line(count):
    result = subprocess.run(
        [sys.executable, "-m", "trainkit.launch", "--nproc", "2", "--devices-per-proc", count, "script.py"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"--devices-per-proc must be at least 1 (fake CPU devices per process); received {count}" in result.stderr


def test_an_index_given_twice_is_named_by_the_processes_that_end_with_trainkits_line():
    from concurrent.futures import ThreadPoolExecutor

    address = f"127.0.0.1:{free_port()}"
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda index: join(address, 3, index)[0], [0, 1, 1]))
    ours = [r for r in results if r.returncode == JOIN_FAILED]
    assert results[0] in ours and "two of them were given one index" in results[0].stderr, results[0].stderr[-1500:]
    assert any("another process was given index 1 too" in r.stderr for r in ours[1:]), [
        r.stderr[-800:] for r in results
    ]
