"""Where one train step's device time goes, by the names trainkit gives its phases: a profile
(``jax.profiler``) of a few steps of ``examples/lm.py``'s model, each executed op mapped to the
phase its compiled instruction's ``op_name`` names (``loss_and_gradients``, ``optimizer_update``,
``apply_updates``, ``metrics``, ``all_reduce``, the step's features: ``grad_norm``,
``label_check``; a step of one's own: ``train_step``, ``apply_gradients_<group>``), printed as a
table of milliseconds per step and shares.

    python benchmarks/step_phases.py                                   # on a chip: the LM in bf16
    python benchmarks/step_phases.py --layers 2 --d-model 64 --length 64 --batch-size 8   # a CPU
"""

from __future__ import annotations

import argparse
import collections
import glob
import pathlib
import re
import sys
import tempfile

import jax
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from lm import ByteLM  # noqa: E402

import trainkit as tk  # noqa: E402

#: the phases trainkit names in its steps (trainkit/core/step.py, custom_step.py, program.py)
PHASES = (
    "loss_and_gradients", "metrics", "all_reduce", "optimizer_update", "apply_updates", "grad_norm",
    "label_check", "skip_spikes", "gradient_statistics", "train_step",
)  # fmt: skip
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?op_name=\"([^\"]*)\"", re.M)


def phase_of(op_name: str) -> str:
    """The first trainkit phase ``op_name`` (``jit(step)/loss_and_gradients/transpose(...)/dot``) names."""
    parts = op_name.split("/")
    for part in parts:
        for phase in PHASES:
            if part == phase or part.startswith(phase + "_") or part.startswith("apply_gradients"):
                return part if part.startswith("apply_gradients") else phase
    return "other"


_COMPUTATION = re.compile(r"^%?([\w.\-]+) .*\{\s*$")
_CALLS = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?calls=%([\w.\-]+)", re.M)


def computation_phases(hlo: str) -> dict[str, list[str]]:
    """Each computation of a compiled module's text (a fusion's body among them) by name, to the
    phases its instructions' ``op_name`` name, in the order of :data:`PHASES`."""
    found: dict[str, set[str]] = {}
    current = None
    for line in hlo.splitlines():
        start = None if line.startswith(" ") else _COMPUTATION.match(line)
        if start:
            current = start.group(1)
            found[current] = set()
        elif current is not None:
            found[current].update(phase_of(op_name) for op_name in re.findall(r'op_name="([^"]*)"', line))
    order = {phase: i for i, phase in enumerate(PHASES)}
    return {name: sorted(phases - {"other"}, key=lambda p: order.get(p, len(order))) for name, phases in found.items()}


def instruction_phases(hlo: str) -> dict[str, str]:
    """Each instruction of a compiled module's text by name, to the phase its ``op_name`` names; a
    fusion the compiler made of several phases' ops (a TPU fuses the optimizer's update into the
    backward pass's last ops) to all of them, joined by ``+``."""
    phases = {name: phase_of(op_name) for name, op_name in _INSTRUCTION.findall(hlo)}
    inside = computation_phases(hlo)
    for name, called in _CALLS.findall(hlo):
        if len(inside.get(called, ())) > 1:
            phases[name] = " + ".join(inside[called])
    return phases


def instruction_name(event: str) -> str:
    """An executed op's instruction name: a TPU profile names it by its whole text.

    >>> instruction_name("%fusion.12 = f32[8]{0} fusion(f32[8]{0} %p), kind=kLoop"), instruction_name("dot.3")
    ('fusion.12', 'dot.3')
    """
    return event[1:].split(" = ", 1)[0] if event.startswith("%") else event


def device_times(folder: str, chip: bool) -> dict[str, float]:
    """Microseconds per executed op name, summed over a profile's device planes ("XLA Ops": not
    the steps, modules or overlapping async copies) on a ``chip``, else the host's events (its
    thunks, and Python's, which match no instruction)."""
    from jax.profiler import ProfileData

    times: dict[str, float] = collections.defaultdict(float)
    for path in glob.glob(f"{folder}/**/*.xplane.pb", recursive=True):
        for plane in ProfileData.from_file(path).planes:
            device = plane.name.startswith("/device:")
            if not (device if chip else plane.name == "/host:CPU"):
                continue
            for line in plane.lines:
                if device and line.name != "XLA Ops":
                    continue
                for event in line.events:
                    times[instruction_name(event.name)] += event.duration_ns / 1e3
    return times


def dump(directory: str, hlo: str, folder: str, chip: bool) -> None:
    """The compiled text and, per profile plane and line, its event names (to see why ops go unmatched)."""
    from jax.profiler import ProfileData

    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compiled.txt").write_text(hlo)
    lines = []
    for path in glob.glob(f"{folder}/**/*.xplane.pb", recursive=True):
        for plane in ProfileData.from_file(path).planes:
            for line in plane.lines:
                events = list(line.events)
                names = collections.Counter(event.name for event in events)
                lines.append(f"{plane.name} | {line.name} | {len(events)} events | {names.most_common(25)}")
                for event in events[:3]:
                    lines.append(f"    stats: {list(event.stats)[:12]}")
    (out / "profile_names.txt").write_text("\n".join(lines))
    times = sorted(device_times(folder, chip).items(), key=lambda item: -item[1])
    (out / "op_times.txt").write_text("\n".join(f"{micros:.1f}\t{name}" for name, micros in times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--dump", default=None, help="write the compiled text and the profile's op names here")
    args = parser.parse_args()
    model = ByteLM(layers=args.layers, d_model=args.d_model, heads=max(1, args.d_model // 64),
                   mlp=4 * args.d_model, max_len=args.length)  # fmt: skip
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(args.batch_size * args.steps, args.length + 1)).astype(np.int32)
    x, y = data[:, :-1], data[:, 1:]
    trainer = tk.Trainer(model, loss="sparse_categorical_crossentropy", optimizer=optax.adamw(1e-3),
                         strategy="single", precision=args.precision, steps_per_execution=1)  # fmt: skip
    trainer.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0)  # compiled and warm
    hlo = trainer.compiled_text((x[: args.batch_size], y[: args.batch_size]))
    phases = instruction_phases(hlo)
    folder = tempfile.mkdtemp(prefix="trainkit-profile-")
    with jax.profiler.trace(folder):
        trainer.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0)
    by_phase: dict[str, float] = collections.defaultdict(float)
    chip = jax.devices()[0].platform != "cpu"  # every event an executed op (a CPU's host plane has Python's too)
    if args.dump:
        dump(args.dump, hlo, folder, chip)
    for op, micros in device_times(folder, chip).items():
        if op in phases or chip:
            by_phase[phases.get(op, "unnamed (ops without an op_name)")] += micros
    total = sum(by_phase.values()) or 1.0
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.layers} x {args.d_model}, length "
          f"{args.length}, batch {args.batch_size}, {args.precision}; {args.steps} steps profiled")  # fmt: skip
    print("| phase | ms per step | share |\n|---|---|---|")
    for phase, micros in sorted(by_phase.items(), key=lambda item: -item[1]):
        print(f"| {phase} | {micros / 1e3 / args.steps:.2f} | {micros / total:.1%} |")


if __name__ == "__main__":
    main()
