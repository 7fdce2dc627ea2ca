"""Where a fused call's time goes (issue #80 item 1): ten calls of the dispatch-bound MLP
(``steps_per_execution.py``'s 32-64-10, batch 32, Adam) at k steps a call, trainkit's fit against a
hand-written ``lax.scan`` of k that ships its slices, each traced with ``jax.profiler``:

- wall time per call (untraced), and the device's busy time per call (the executed modules on the device's
  planes; on a CPU the host's XLA thunks), so ``wall - busy`` is what the host adds;
- the device's time per call by executed op (on a chip);
- the host's time per call by function (``cProfile`` of the same ten calls, its own time, the
  functions that take most).

    python benchmarks/fused_call_profile.py                 # on the chip: k = 32 and 128
    python benchmarks/fused_call_profile.py --k 8 --calls 4 # a smoke test on a CPU
"""

from __future__ import annotations

import argparse
import cProfile
import glob
import pathlib
import pstats
import sys
import tempfile
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import step_phases  # noqa: E402
import steps_per_execution as spe  # noqa: E402


def device_busy_seconds(folder: str) -> float:
    """Seconds the device spent executing modules in a trace (the "XLA Modules" line of each device plane;
    a CPU has none: its XLA thunks on the host plane instead)."""
    from jax.profiler import ProfileData

    total_ns, chip = 0.0, jax.devices()[0].platform != "cpu"
    for path in glob.glob(f"{folder}/**/*.xplane.pb", recursive=True):
        for plane in ProfileData.from_file(path).planes:
            if chip and plane.name.startswith("/device:"):
                modules = [line for line in plane.lines if line.name == "XLA Modules"]
                total_ns += sum(event.duration_ns for line in modules for event in line.events)
            elif not chip and plane.name == "/host:CPU":
                total_ns += sum(e.duration_ns for line in plane.lines for e in line.events if "Thunk" in e.name)
    return total_ns / 1e9


def profile(name: str, run, calls: int, top: int) -> list[str]:
    """One contender: ``run()`` does ``calls`` fused calls (warmed up first)."""
    run()
    walls = []
    for _ in range(3):
        start = time.perf_counter()
        run()
        walls.append(time.perf_counter() - start)
    wall = sorted(walls)[1]
    folder = tempfile.mkdtemp(prefix="fused-call-")
    with jax.profiler.trace(folder):
        run()
    busy = device_busy_seconds(folder)
    ops = sorted(step_phases.device_times(folder, jax.devices()[0].platform != "cpu").items(), key=lambda kv: -kv[1])
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    stats = pstats.Stats(profiler).sort_stats("tottime")
    per_call = f"wall {wall / calls * 1e3:.3f} ms per call (untraced, median of 3)"
    lines = [f"### {name}: {per_call}, device busy {busy / calls * 1e3:.3f} ms"]
    lines.append("| function (own time) | ms per call | calls per call |\n|---|---|---|")
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]  # type: ignore[attr-defined]
    for (filename, line, function), (_, count, own, _, _) in rows:
        where = "/".join(pathlib.Path(filename).parts[-2:])
        lines.append(f"| {function} ({where}:{line}) | {own / calls * 1e3:.3f} | {count / calls:.1f} |")
    lines.append("| device op | us per call |\n|---|---|")
    lines += [f"| {op[:60]} | {micros / calls:.1f} |" for op, micros in ops[:top]]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    device = jax.devices()[0]
    print(f"jax {jax.__version__}, {device.platform} {device.device_kind}; MLP 32-64-10, batch 32, {args.calls} calls")
    for k in args.k:
        x, y = spe.dataset(k * args.calls)
        for name, run in (("trainkit", spe.trainkit_fit(x, y, k)), ("hand scan", spe.hand_written(x, y, k))):
            print("\n".join(profile(f"{name}, k={k}", run, args.calls, args.top)) + "\n", flush=True)


if __name__ == "__main__":
    main()
