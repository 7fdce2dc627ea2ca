"""Start a multi-process run on this machine: ``python -m trainkit.launch --nproc 2 script.py``.

Each process gets ``JAX_COORDINATOR_ADDRESS`` (loopback), ``JAX_NUM_PROCESSES`` and
``JAX_PROCESS_ID``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (each takes its share of the
machine's GPUs: 2 processes on 8 GPUs take 4 each, also inside a SLURM allocation), and with
``--devices-per-proc K`` that many fake CPU devices, so the unchanged script connects through
``tk.distributed.initialize``. Output lines are prefixed with
the process index. If a process fails, the launcher says which, ends the others and exits with
its code, a ``sys.exit(3)`` outside ``fit`` included (each process runs the script through
:mod:`trainkit.distributed.script_runner`); for a cluster, see docs/multihost.md.

    python -m trainkit.launch --nproc 2 --devices-per-proc 4 examples/digits_cnn.py --epochs 3

>>> build_env({"PATH": "/bin"}, process_id=1, nproc=2, port=1234, devices_per_proc=4)["JAX_PROCESS_ID"]
'1'
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

#: Seconds the processes get to exit after a SIGTERM or SIGINT the launcher forwarded (a preemption: every
#: process is alive and can write its backup) before they are killed.
GRACE_SECONDS = 5.0
#: Seconds the others get after one process failed: they wait in a collective for the failed one, and JAX's
#: preemption notifier takes SIGTERM without ending them (they would sit until the coordination service's
#: heartbeat timeout, ~20 s), so they are killed after this long.
PEER_FAILED_GRACE_SECONDS = 1.0
#: Seconds the launcher waits after a first failure for the others, to tell cause from effect.
SETTLE_SECONDS = 10.0
#: Each process's first error line, by process index: ``(when it was read, the line)``.
Errors = dict[int, tuple[float, str]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def build_env(
    base: Mapping[str, str], *, process_id: int, nproc: int, port: int, devices_per_proc: int | None
) -> dict[str, str]:
    env = dict(base)
    env.update(
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES=str(nproc),
        JAX_PROCESS_ID=str(process_id),
        LOCAL_RANK=str(process_id),  # all on this machine: each takes its share of its GPUs
        LOCAL_WORLD_SIZE=str(nproc),
        TRAINKIT_LAUNCH="1",
        PYTHONUNBUFFERED="1",
    )
    if devices_per_proc is not None:
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_NUM_CPU_DEVICES"] = str(devices_per_proc)
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices_per_proc}"])
    return env


def _relay(index: int, stream: IO[str], lock: threading.Lock, errors: Errors) -> None:
    for line in iter(stream.readline, ""):
        if _ERROR_LINE.match(line):  # a traceback's last line; the first one is the root cause of a chain
            errors.setdefault(index, (time.monotonic(), line.strip()))
        with lock:
            sys.stdout.write(f"[{index}] {line}" if line.endswith("\n") else f"[{index}] {line}\n")
            sys.stdout.flush()
    stream.close()


# Errors a process gets because a peer died, not why the job failed.
_SECONDARY = re.compile(r"Gloo|Connection reset|Coordination|heartbeat|Barrier|DEADLINE_EXCEEDED|UNAVAILABLE", re.I)


def _secondary(process: subprocess.Popen[str], error: tuple[float, str] | None) -> bool:
    """A failure caused by a peer's death: a torn-down collective, or (without a Python error
    of its own) the coordination service's abort."""
    if error is not None:
        return bool(_SECONDARY.search(error[1]))
    return bool(process.returncode == -signal.SIGABRT)


_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*:")


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the launcher dies, even by SIGKILL (Linux). Not
    SIGTERM: JAX's preemption notifier takes it, and a process waiting in a collective would stay."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the launcher's own handlers still forward
        pass


def launch(command: Sequence[str], nproc: int, devices_per_proc: int | None = None, port: int | None = None) -> int:
    """Runs ``command`` as ``nproc`` processes; returns 0, or the first failing process's code.
    SIGTERM and SIGINT sent to the launcher are forwarded to every process (which then end
    within ``GRACE_SECONDS``); when one fails, the others are ended within
    ``PEER_FAILED_GRACE_SECONDS``; the processes die with the launcher."""
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1; received {nproc}.")
    if devices_per_proc is not None and devices_per_proc < 1:
        raise ValueError(
            f"--devices-per-proc must be at least 1 (fake CPU devices per process); received {devices_per_proc}. "
            "Leave it out for each process's real devices."
        )
    port = port or free_port()
    lock = threading.Lock()
    processes: list[subprocess.Popen[str]] = []
    relays: list[threading.Thread] = []
    errors: Errors = {}
    received: list[int] = []
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, lambda number, frame: received.append(number))
    try:
        for index in range(nproc):
            env = build_env(
                dict(os.environ), process_id=index, nproc=nproc, port=port, devices_per_proc=devices_per_proc
            )
            process = subprocess.Popen(
                list(command),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
            processes.append(process)
            relay = threading.Thread(target=_relay, args=(index, process.stdout, lock, errors), daemon=True)
            relay.start()
            relays.append(relay)
        failed = _watch(processes, received, errors, relays)
        if failed is not None:
            index, code = failed
            if index >= 0:
                relays[index].join(timeout=2)  # its last lines, with the error
            with lock:
                if index < 0:
                    who = f"received {signal.Signals(-code).name}, forwarded to every process"
                else:
                    error = f" ({errors[index][1]})" if index in errors else ""
                    who = f"process {index} {_describe(code)}{error}"
                print(f"[launch] {who}; ending the other processes", flush=True)
            if index < 0:
                _end(processes, signal.Signals(-code), GRACE_SECONDS)
            else:
                _end(processes, signal.SIGTERM, PEER_FAILED_GRACE_SECONDS)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for process in processes:  # never leave a child behind
            if process.poll() is None:
                process.kill()
    for relay in relays:
        relay.join(timeout=5)
    if failed is None:
        return 0
    index, code = failed
    return 128 - code if index < 0 or code < 0 else code


def _watch(
    processes: list[subprocess.Popen[str]], received: list[int], errors: Errors, relays: list[threading.Thread]
) -> tuple[int, int] | None:
    """``(index, code)`` of the process that failed first, ``(-1, -signum)`` for a signal the
    launcher received, or ``None`` when every process exited with 0. A peer that fails
    *because* another died (a collective's connection reset) prints its error after the first
    one did, with a torn-down collective (or the coordination service's abort): the launcher
    waits up to ``SETTLE_SECONDS`` for a failure of its own and blames it, else the first."""
    exited: dict[int, float] = {}

    def note(index, process):
        process.wait()
        when = time.monotonic()
        relays[index].join(timeout=2)  # its last lines (the error) read before it is judged
        exited[index] = when

    for index, process in enumerate(processes):
        threading.Thread(target=note, args=(index, process), daemon=True).start()
    while len(exited) < len(processes):
        if received:
            return -1, -received[0]
        if any(processes[i].returncode != 0 for i in list(exited)):
            deadline = time.monotonic() + SETTLE_SECONDS
            while len(exited) < len(processes) and time.monotonic() < deadline:
                if any(not _secondary(processes[i], errors.get(i)) for i in list(exited) if processes[i].returncode):
                    break  # a failure of its own: the cause, not a consequence
                time.sleep(0.05)
            time.sleep(0.2)  # processes failing together: let their error lines arrive
            break
        time.sleep(0.05)
    failures = [i for i in list(exited) if processes[i].returncode != 0]
    if not failures:
        return None
    first = min(
        failures,
        key=lambda i: (_secondary(processes[i], errors.get(i)), min(errors.get(i, (exited[i],))[0], exited[i])),
    )
    return first, processes[first].returncode


def _end(processes: list[subprocess.Popen[str]], signum: signal.Signals, grace: float) -> None:
    """Sends ``signum`` to the processes still running and kills those not ended ``grace`` seconds later."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signum)
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainkit.launch", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, required=True, help="processes to start")
    parser.add_argument(
        "--devices-per-proc", type=int, default=None, help="fake this many CPU devices in each process (CPU only)"
    )
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    parser.add_argument("script", help="the Python script every process runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    args = parser.parse_args(argv)
    refuse_inside_a_job(args.nproc)
    try:
        command = [sys.executable, "-m", "trainkit.distributed.script_runner", args.script, *args.args]  # sees sys.exit
        return launch(command, args.nproc, args.devices_per_proc, args.port)
    except ValueError as error:  # the arguments' own check: a usage line, not a traceback
        parser.error(str(error))


def refuse_inside_a_job(nproc: int, env: dict[str, str] | None = None) -> None:
    """A ``SystemExit`` naming the fix when the launcher is itself one task of a multi-process job
    (``srun -n2 python -m trainkit.launch ...``): each task would start its own job on its
    machine, N silent copies. ``srun -n1`` (one launcher in an allocation) is fine.

    >>> refuse_inside_a_job(2, {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "1",
    ...                         "SLURM_PROCID": "0", "SLURM_LOCALID": "0"})
    """
    from trainkit.distributed import engines  # the launcher's one trainkit import: no JAX

    job = engines.detect_job(os.environ if env is None else env)
    if job is not None and job.several:
        raise SystemExit(
            f"python -m trainkit.launch is task {job.process_id} of a {job.engine} job of {job.num_processes} "
            f"processes: each task would start its own {nproc}-process job on its machine, {job.num_processes} "
            f"independent copies. Let {job.engine} start the processes (e.g. srun -n{nproc} python script.py, no "
            "launcher), or start one launcher (srun -n1 python -m trainkit.launch ...)."
        )


if __name__ == "__main__":
    sys.exit(main())
