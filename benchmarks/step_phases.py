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


def instruction_phases(hlo: str) -> dict[str, str]:
    """Each instruction of a compiled module's text by name, to the phase its ``op_name`` names."""
    return {name: phase_of(op_name) for name, op_name in _INSTRUCTION.findall(hlo)}


def device_times(folder: str) -> dict[str, float]:
    """Microseconds per executed op name, summed over a profile's device planes (the host's
    thunks on a CPU)."""
    from jax.profiler import ProfileData

    times: dict[str, float] = collections.defaultdict(float)
    for path in glob.glob(f"{folder}/**/*.xplane.pb", recursive=True):
        for plane in ProfileData.from_file(path).planes:
            if not (plane.name.startswith("/device:") or plane.name == "/host:CPU"):
                continue
            for line in plane.lines:
                for event in line.events:
                    times[event.name] += event.duration_ns / 1e3
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--precision", default="bf16")
    args = parser.parse_args()
    model = ByteLM(layers=args.layers, d_model=args.d_model, heads=max(1, args.d_model // 64),
                   mlp=4 * args.d_model, max_len=args.length)  # fmt: skip
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(args.batch_size * args.steps, args.length + 1)).astype(np.int32)
    x, y = data[:, :-1], data[:, 1:]
    trainer = tk.Trainer(model, loss="sparse_categorical_crossentropy", optimizer=optax.adamw(1e-3),
                         strategy="single", precision=args.precision, steps_per_execution=1)  # fmt: skip
    trainer.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0)  # compiled and warm
    phases = instruction_phases(trainer.compiled_text((x[: args.batch_size], y[: args.batch_size])))
    folder = tempfile.mkdtemp(prefix="trainkit-profile-")
    with jax.profiler.trace(folder):
        trainer.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0)
    by_phase: dict[str, float] = collections.defaultdict(float)
    for op, micros in device_times(folder).items():
        if op in phases:
            by_phase[phases[op]] += micros
    total = sum(by_phase.values()) or 1.0
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.layers} x {args.d_model}, length "
          f"{args.length}, batch {args.batch_size}, {args.precision}; {args.steps} steps profiled")  # fmt: skip
    print("| phase | ms per step | share |\n|---|---|---|")
    for phase, micros in sorted(by_phase.items(), key=lambda item: -item[1]):
        print(f"| {phase} | {micros / 1e3 / args.steps:.2f} | {micros / total:.1%} |")


if __name__ == "__main__":
    main()
