"""Start a multi-process run on this machine: ``python -m trainkit.launch --nproc 2 script.py``.

Each process gets ``JAX_COORDINATOR_ADDRESS`` (loopback), ``JAX_NUM_PROCESSES`` and
``JAX_PROCESS_ID`` (and with ``--devices-per-proc K`` that many fake CPU devices), so the
unchanged script connects through ``tk.distributed.initialize``. Output lines are prefixed with
the process index. If a process fails, the launcher says which, ends the others and exits with
its code; for a cluster, see docs/multihost.md.

    python -m trainkit.launch --nproc 2 --devices-per-proc 4 examples/digits_cnn.py --epochs 3

>>> build_env({"PATH": "/bin"}, process_id=1, nproc=2, port=1234, devices_per_proc=4)["JAX_PROCESS_ID"]
'1'
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

#: Seconds the other processes get to exit after SIGTERM before they are killed.
GRACE_SECONDS = 5.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_env(base: dict, *, process_id: int, nproc: int, port: int, devices_per_proc: int | None) -> dict:
    env = dict(base)
    env.update(
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES=str(nproc),
        JAX_PROCESS_ID=str(process_id),
        PYTHONUNBUFFERED="1",
    )
    if devices_per_proc:
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_NUM_CPU_DEVICES"] = str(devices_per_proc)
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices_per_proc}"])
    return env


def _relay(index: int, stream, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            sys.stdout.write(f"[{index}] {line}" if line.endswith("\n") else f"[{index}] {line}\n")
            sys.stdout.flush()
    stream.close()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def launch(command: Sequence[str], nproc: int, devices_per_proc: int | None = None, port: int | None = None) -> int:
    """Runs ``command`` as ``nproc`` processes; returns 0, or the first failing process's code."""
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1; received {nproc}.")
    port = port or free_port()
    lock = threading.Lock()
    processes, relays = [], []
    for index in range(nproc):
        env = build_env(os.environ, process_id=index, nproc=nproc, port=port, devices_per_proc=devices_per_proc)
        process = subprocess.Popen(
            list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        processes.append(process)
        relay = threading.Thread(target=_relay, args=(index, process.stdout, lock), daemon=True)
        relay.start()
        relays.append(relay)
    failed = None
    try:
        while failed is None and any(p.poll() is None for p in processes):
            for index, process in enumerate(processes):
                code = process.poll()
                if code not in (None, 0):
                    failed = (index, code)
                    break
            time.sleep(0.05)
        if failed is None:
            failed = next(((i, p.returncode) for i, p in enumerate(processes) if p.returncode), None)
    except KeyboardInterrupt:
        failed = (-1, 130)
    if failed is not None:
        index, code = failed
        with lock:
            who = "interrupted" if index < 0 else f"process {index} {_describe(code)}"
            print(f"[launch] {who}; ending the other processes", flush=True)
        _end(processes)
    for relay in relays:
        relay.join(timeout=5)
    if failed is None:
        return 0
    return failed[1] if failed[1] > 0 else 128 - failed[1]


def _end(processes) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + GRACE_SECONDS
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
    return launch([sys.executable, args.script, *args.args], args.nproc, args.devices_per_proc, args.port)


if __name__ == "__main__":
    sys.exit(main())
