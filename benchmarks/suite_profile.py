"""Where the test suite's time goes: a pytest plugin that records, per test file, the CPU seconds of
the test process and of the child processes its tests start, and JAX's own compile figures (the
seconds of tracing, lowering and backend compiles, by the compiled function's name); run as a
script, it prints the table of the last run.

    PYTHONPATH=benchmarks .venv/bin/python -m pytest -p suite_profile -n 2 --dist loadfile \\
        --no-loadscope-reorder -q tests --ignore=tests/engines
    .venv/bin/python benchmarks/suite_profile.py

Each process writes ``stats-<pid>.json`` to ``$SUITE_PROFILE_DIR`` (default: ``suite-profile`` in
the temporary directory), which the run's first process empties of earlier ``stats-*.json`` files.
Every column but ``tests`` is seconds. A program JAX loaded from its persistent cache is counted
under ``backend_compile`` too (with the seconds of the load); ``cache_load`` is the seconds those
loads took.

>>> table({"test_a": {"wall": 2.0, "cpu": 1.5, "children": 0.5, "tests": 1}}, {})[1].split()[:3]
['2.0', '1.5', '0.5']
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import resource
import sys
import tempfile
import time
from typing import Any

#: JAX's duration events this plugin sums, by their short names
EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "backend_compile",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_load",
}
COLUMNS = ("wall", "cpu", "children", "trace", "lower", "backend_compile", "cache_load", "tests")

_by_file: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
_by_function: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
_current = ["(collection)"]
_started = [0.0, 0.0, 0.0]  # the running test's start: wall clock, this process's CPU, its children's CPU


def folder() -> pathlib.Path:
    """Where each process writes its figures and the script reads them."""
    return pathlib.Path(os.environ.get("SUITE_PROFILE_DIR") or pathlib.Path(tempfile.gettempdir(), "suite-profile"))


def _on_duration(event: str, seconds: float, **labels: Any) -> None:
    name = EVENTS.get(event)
    if name is None:
        return
    _by_file[_current[0]][name] += seconds
    function = _by_function[str(labels.get("fun_name", "?"))]
    function[name] += seconds
    function[name + "_count"] += 1


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def pytest_configure(config: Any) -> None:
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    if not hasattr(config, "workerinput"):  # the run's first process: a new table
        folder().mkdir(parents=True, exist_ok=True)
        for old in folder().glob("stats-*.json"):
            old.unlink()


def pytest_runtest_protocol(item: Any, nextitem: Any) -> None:
    _current[0] = item.path.stem
    _by_file[_current[0]]["tests"] += 1
    _started[:] = [time.perf_counter(), _cpu_seconds(resource.RUSAGE_SELF), _cpu_seconds(resource.RUSAGE_CHILDREN)]


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    wall, cpu, children = _started
    counter = _by_file[_current[0]]
    counter["wall"] += time.perf_counter() - wall
    counter["cpu"] += _cpu_seconds(resource.RUSAGE_SELF) - cpu
    counter["children"] += _cpu_seconds(resource.RUSAGE_CHILDREN) - children


def pytest_sessionfinish(session: Any) -> None:
    if not _by_file or set(_by_file) == {"(collection)"}:
        return
    folder().mkdir(parents=True, exist_ok=True)
    record = {
        "files": {k: dict(v) for k, v in _by_file.items()},
        "functions": {k: dict(v) for k, v in _by_function.items()},
    }
    (folder() / f"stats-{os.getpid()}.json").write_text(json.dumps(record))


def table(files: dict[str, dict[str, float]], functions: dict[str, dict[str, float]], top: int = 15) -> list[str]:
    """The lines of the table: the files by their wall seconds (a total first), then the compiled
    functions by their backend-compile seconds."""
    rows = sorted(files.items(), key=lambda item: -item[1].get("wall", 0.0))
    totals: collections.Counter[str] = collections.Counter()
    lines = [" ".join(f"{column:>9}" for column in COLUMNS) + "  file"]
    for name, figures in rows:
        totals.update(figures)
        lines.append(" ".join(f"{figures.get(column, 0.0):9.1f}" for column in COLUMNS) + f"  {name}")
    lines.insert(1, " ".join(f"{totals.get(column, 0.0):9.1f}" for column in COLUMNS) + "  (all)")
    if functions:
        lines.append("")
        lines.append(f"{'compile s':>9} {'compiles':>9} {'lower s':>9}  function")
        for name, figures in sorted(functions.items(), key=lambda item: -item[1].get("backend_compile", 0.0))[:top]:
            count, lowered = figures.get("backend_compile_count", 0.0), figures.get("lower", 0.0)
            lines.append(f"{figures.get('backend_compile', 0.0):9.1f} {count:9.0f} {lowered:9.1f}  {name}")
    return lines


def main() -> int:
    files: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    functions: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    paths = sorted(folder().glob("stats-*.json"))
    if not paths:
        print(f"no stats-*.json in {folder()}: run the suite with -p suite_profile first (this file's docstring)")
        return 1
    for path in paths:
        record = json.loads(path.read_text())
        for name, figures in record["files"].items():
            files[name].update(figures)
        for name, figures in record["functions"].items():
            functions[name].update(figures)
    print("\n".join(table({k: dict(v) for k, v in files.items()}, {k: dict(v) for k, v in functions.items()})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
