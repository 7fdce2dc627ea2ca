"""The largest model a target holds: for a GPT family (the LM example's blocks, ``examples/lm.py``;
sequence 2,048, bf16 compute, fp32 master weights, AdamW), the largest parameter count whose
compiled FSDP train step fits, per target, under five configurations, beside the arithmetic
bound and their ratio.

Configurations: FSDP; FSDP + remat (of the blocks); FSDP + remat + optimizer offload; LoRA of
rank 16 on a frozen bf16 base (every kernel, attention's included); LoRA of rank 16 on an nf4
base (QLoRA) of the Dense kernels (the MLP's and the head's): qwix cannot tell attention's
quantised einsum kernels apart (docs/finetuning.md), so those stay frozen bf16, unadapted. Targets: ``tpu v5e:2x4``,
``tpu v5p:2x2x1`` and ``h100 x8`` (``h100`` needs the ``gpu-plan`` extra), compiled here, never
run, from shapes (no array of the batch's size is built).

The family: ``layers`` blocks (default 4) of width ``d = 128 m`` (heads of 128, an MLP of
``4 d``), byte vocabulary, one sequence of 2,048 tokens per device. The search compiles two
small widths first (``m`` = 8 and 16), reads the bytes per parameter of the state and fits the
other temporaries as ``a m^2 + b m``, predicts the largest width, and from there closes the
bracket between the widest width that fits and the narrowest that does not, each next width
predicted from the two compiled widths nearest the edge (halving the bracket after two
overshoots), until they are one head apart (a few compiles a row; each compile of a large
width takes minutes on 2 cores).

The bound: ``(limit x 0.9 - activations) x devices / bytes per parameter``, where 0.9 is the
plan's headroom, the activations are the compiled step's temporaries less its gradients, and
the bytes per parameter are the state's own (parameters, optimizer state and gradients in device
memory, counted from the abstract state: offloaded moments count nothing, an nf4 kernel half a
byte plus its scales). The ratio is the found parameter count over the bound.

    python benchmarks/capacity.py [--targets "tpu v5e:2x4" ...] [--configs fsdp ...] [--layers 4] [--out F]
    python benchmarks/capacity.py --plot capacity.json docs/images/capacity.png   # the rows found, as bars
    python benchmarks/capacity.py --axes   # the longest sequence with and without a context axis; two slices

The longest sequence one chip trains with ``tk.attention``'s kernel against XLA's attention (the
12 x 1,024 model at batch 1), measured on a v5e chip beside the same search compiled here for
``"tpu v5e:2x2"``, is ``benchmarks/attention_lengths.py`` (its figures: ``attention_lengths_results.jsonl``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # libtpu's compile-only client, quietly
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from lm import ByteLM  # noqa: E402

import trainkit as tk  # noqa: E402
from trainkit.planning import plan as plan_lib  # noqa: E402
from trainkit.planning import targets as targets_lib  # noqa: E402

LENGTH = 2048
TARGETS = ("tpu v5e:2x4", "tpu v5p:2x2x1", "h100 x8")
#: heads searched in multiples of this per target: XLA's GPU compiler gives head counts that are
#: not multiples of 8 (129 to 133) three to four times the temporaries of their neighbours
HEAD_STEP = {"h100 x8": 8}
BF16_BASE = tk.Precision(param_dtype="bfloat16", compute_dtype="bfloat16")
CONFIGS = {
    "fsdp": {"precision": "bf16"},
    "fsdp + remat": {"precision": "bf16", "remat": ["Block"]},
    "fsdp + remat + offload": {"precision": "bf16", "remat": ["Block"], "offload": "optimizer"},
    "lora 16, bf16 base": {"precision": BF16_BASE, "lora": tk.LoRA(rank=16, alpha=32.0)},
    "lora 16, nf4 base": {
        "precision": BF16_BASE,  # the kernels not quantised (attention's, the embeddings) bf16 too
        "lora": tk.LoRA(rank=16, alpha=32.0, quantize_base="nf4", targets="Dense"),
    },
}


def model(m: int, layers: int) -> ByteLM:
    d = 128 * m
    return ByteLM(layers=layers, d_model=d, heads=m, mlp=4 * d, max_len=LENGTH)


def parameter_count(m: int, layers: int) -> int:
    """The float model's parameters (the adapters and quantisation aside): from its shapes."""
    shapes = jax.eval_shape(model(m, layers).init, jax.random.key(0), jnp.zeros((1, LENGTH), jnp.int32))
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes))


@dataclasses.dataclass
class Probe:
    m: int
    layers: int
    parameters: int
    fits: bool
    total: float  # bytes per device
    temp: float
    state_per_device: float  # the state's device bytes per device (parameters, optimizer state)
    grads_per_device: float
    seconds: float
    error: str | None = None


def probe(m: int, layers: int, config: dict, target: str, devices: int) -> Probe:
    start = time.perf_counter()
    trainer = tk.Trainer(
        model(m, layers), loss="sparse_categorical_crossentropy", optimizer=optax.adamw(1e-4), strategy="auto", **config
    )
    tokens = jax.ShapeDtypeStruct((devices, LENGTH), np.int32)
    plan = trainer.plan((tokens, tokens), target=target, candidates=["fsdp"], verbose=0, add_measures=False)
    row = plan.rows[0]
    parts = plan.state_bytes
    trainable = parts["trainable params"]
    optimizer = 0 if config.get("offload") else parts["optimizer state"]
    state = (trainable + parts["frozen params"] + optimizer + parts["model state"]) / devices
    return Probe(
        m,
        layers,
        parameter_count(m, layers),
        row.fits,
        float(row.total_bytes),
        float(row.temp_bytes),
        state,
        trainable / devices,  # fp32 gradients of the trainable parameters, sharded as they are
        time.perf_counter() - start,
        row.error,
    )


def predicted(first: Probe, second: Probe, limit: float) -> int:
    """The largest ``m`` whose state, gradients and other temporaries fit, from two probes: the
    state and gradients scale as the parameters; the rest of the temporaries (activations,
    attention scores, the gathered bf16 weights of a block) as ``a m^2 + b m``, solved from both."""
    budget = plan_lib.HEADROOM * limit
    per_parameter = (second.state_per_device + second.grads_per_device) / second.parameters
    rest = [(p.m, max(p.temp - p.grads_per_device, 0.0)) for p in (first, second)]
    (m1, r1), (m2, r2) = rest
    a = (r2 / m2 - r1 / m1) / (m2 - m1)  # r/m = a m + b
    b = r1 / m1 - a * m1
    layers = second.layers
    best = second.m
    for m in range(first.m, 4096):
        if parameter_count_estimate(m, layers) * per_parameter + max(a * m * m + b * m, 0.0) > budget:
            break
        best = m
    return best


def parameter_count_estimate(m: int, layers: int) -> float:
    d = 128 * m
    return layers * (12 * d * d + 2 * d) + d * (2 * 256 + LENGTH + 1)


def search(config_name: str, target: str, layers: int) -> dict:
    config = CONFIGS[config_name]
    resolved = targets_lib.parse(target)
    devices, limit = len(resolved.devices()), float(resolved.memory_limit)
    step = HEAD_STEP.get(target, 1)
    probes = [probe(m, layers, config, target, devices) for m in (8, 16)]
    if not probes[0].fits:
        raise SystemExit(f"{config_name} on {target}: even width 1024 does not fit ({probes[0].error})")
    while True:  # a bracket (the widest that fits, the narrowest that does not) closed by predictions
        fits = max(p.m for p in probes if p.fits)
        over = min((p.m for p in probes if not p.fits), default=None)
        if over is not None and over - fits <= step:
            break
        compiled = sorted((p for p in probes if p.error is None), key=lambda p: p.m)[-2:]  # nearest the edge
        high = 4095 if over is None else over - step
        guess = predicted(compiled[0], compiled[1], limit) if len(compiled) == 2 else (fits + high) // 2
        if over is not None and not probes[-1].fits and not probes[-2].fits and high - fits > 4 * step:
            guess = (fits + over) // 2  # two predictions overshot in a row: halve the bracket instead
        guess = min(max(guess // step * step, fits + step), high)
        probes.append(probe(guess, layers, config, target, devices))
    found = max((p for p in probes if p.fits), key=lambda p: p.m)
    per_parameter = (found.state_per_device + found.grads_per_device) * devices / found.parameters
    activations = max(found.temp - found.grads_per_device, 0.0)
    bound = (plan_lib.HEADROOM * limit - activations) * devices / per_parameter
    return {
        "target": target,
        "config": config_name,
        "layers": layers,
        "width": 128 * found.m,
        "parameters": found.parameters,
        "bytes_per_parameter": per_parameter,
        "activations_per_device": activations,
        "bound": bound,
        "ratio": found.parameters / bound,
        "total_per_device": found.total,
        "limit": limit,
        "probes": [dataclasses.asdict(p) for p in probes],
    }


def plot(results: str, image: str) -> None:
    """The rows of a results file as bars: the largest model found and the bound, per target and
    configuration, with the ratio written above."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in pathlib.Path(results).read_text().splitlines() if line.strip()]
    labels = [f"{row['target']}\n{row['config']}" for row in rows]
    found = [row["parameters"] / 1e9 for row in rows]
    bound = [row["bound"] / 1e9 for row in rows]
    positions = np.arange(len(rows))
    figure, axes = plt.subplots(figsize=(max(7.0, 1.6 * len(rows)), 4.5))
    axes.bar(positions - 0.2, found, 0.4, label="largest that compiles and fits")
    axes.bar(positions + 0.2, bound, 0.4, label="arithmetic bound", alpha=0.6)
    for x, row in zip(positions, rows, strict=True):
        axes.text(x, max(row["parameters"], row["bound"]) / 1e9, f"{row['ratio']:.2f}", ha="center", va="bottom")
    axes.set_xticks(positions, labels, fontsize=8)
    axes.set_ylabel("parameters (billions)")
    axes.set_title(f"GPT blocks, sequence {LENGTH}, bf16, AdamW (compiled here, not run)", fontsize=9)
    axes.legend()
    figure.tight_layout()
    figure.savefig(image, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plot", nargs=2, metavar=("RESULTS", "IMAGE"), help="draw a results file and stop")
    parser.add_argument("--targets", nargs="*", default=list(TARGETS))
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default="capacity.json", help="results, one JSON object per row, appended")
    parser.add_argument("--axes", action="store_true", help="the context and pipeline rows (capacity_axes.py)")
    args = parser.parse_args()
    if args.plot:
        plot(*args.plot)
        return
    if args.axes:
        import capacity_axes

        for row in capacity_axes.slice_rows() + capacity_axes.sequence_rows():
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as file:
                file.write(json.dumps(row) + "\n")
        return
    print(f"jax {jax.__version__}, trainkit {tk.__version__}; {args.layers} layers, sequence {LENGTH}")
    header = f"{'target':15} {'config':24} {'width':>6} {'params':>9} {'B/param':>8} {'bound':>9} {'ratio':>6} {'s':>6}"
    print(header + "\n" + "-" * len(header))
    for target in args.targets:
        for name in args.configs:
            start = time.perf_counter()
            row = search(name, target, args.layers)
            row["seconds"] = time.perf_counter() - start
            with open(args.out, "a") as file:
                file.write(json.dumps(row) + "\n")
            print(
                f"{target:15} {name:24} {row['width']:>6} {row['parameters'] / 1e9:8.2f}B "
                f"{row['bytes_per_parameter']:8.2f} {row['bound'] / 1e9:8.2f}B {row['ratio']:6.3f} "
                f"{row['seconds']:6.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
