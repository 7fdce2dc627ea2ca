"""The longest sequence one chip trains, kernel against XLA attention (issue #71): for
``examples/lm.py``'s 12 x 1,024 model (8 heads of 128, an MLP of 4,096) at batch 1 in bf16 with
AdamW, the longest length (a multiple of ``--step`` tokens) whose compiled train step fits the
device, found by compiling (``trainer.plan``: doubling, then halving the bracket), then one real
step run at the length found. ``pallas``: each block's attention by ``tk.attention`` (the Pallas
kernel on a TPU); ``xla``: written out (the scores of length^2 per head in device memory). Prints
a row per compile and one JSON line.

    source .whl-tpu/install.sh && python3 benchmarks/attention_lengths.py          # on the chip
    python3 benchmarks/attention_lengths.py --time-at 2048                    # the step's speed at 2,048, on the chip
    python benchmarks/attention_lengths.py --target "tpu v5e:2x2"           # the same search, compile-only here
    python benchmarks/attention_lengths.py --layers 2 --d-model 128 --heads 1 --start 128 --step 128 \\
        --limit-bytes 200e6                                                          # a CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from lm import ByteLM  # noqa: E402

import trainkit as tk  # noqa: E402
from trainkit.planning import targets  # noqa: E402


def trainer(args: argparse.Namespace, attention: str, length: int) -> tk.Trainer:
    model = ByteLM(
        layers=args.layers,
        d_model=args.d_model,
        heads=args.heads,
        mlp=4 * args.d_model,
        max_len=length,
        jax_attention=attention == "pallas",
    )
    return tk.Trainer(
        model, loss="sparse_categorical_crossentropy", optimizer=optax.adamw(1e-4), precision="bf16", strategy="single"
    )


def fits(args: argparse.Namespace, attention: str, length: int) -> bool:
    """Whether the train step at ``length`` fits the device (or ``--limit-bytes``), by compiling it."""
    start = time.perf_counter()
    rows = 1
    options: dict = {"memory_limit": int(args.limit_bytes)} if args.limit_bytes else {}
    if args.target:  # DataParallel over the slice: each chip holds the whole state and one row, as one chip alone
        rows = targets.parse(args.target).device_count
        options |= {"target": args.target, "candidates": ["dp"]}
    tokens = jax.ShapeDtypeStruct((rows, length), np.int32)
    plan = trainer(args, attention, length).plan((tokens, tokens), verbose=0, add_measures=False, **options)
    row = plan.rows[0]
    if row.error and not row.error.startswith(("The train step", "RESOURCE_EXHAUSTED")) and "memory" not in row.error:
        raise RuntimeError(row.error)
    print(
        f"  {attention:6} {length:7,} tokens: {'fits' if row.fits else 'too big'}, "
        f"{row.total_bytes / 2**30:.2f} GiB ({time.perf_counter() - start:.0f} s)",
        flush=True,
    )
    return row.fits


def longest(args: argparse.Namespace, attention: str) -> int:
    """The longest multiple of ``args.step`` that fits: doubling from ``args.start``, then bisecting."""
    low, high = 0, args.start
    while high <= args.max_length and fits(args, attention, high):
        low, high = high, high * 2
    if low == 0:
        return 0
    high = min(high, args.max_length + args.step)
    while high - low > args.step:
        middle = (low + high) // 2 // args.step * args.step
        low, high = (middle, high) if fits(args, attention, middle) else (low, middle)
    return low


def runs(args: argparse.Namespace, attention: str, length: int) -> float:
    """Seconds per real step at ``length``: a ``fit`` of 3 rows at batch 1 (compiled), then a second, timed."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(3, length + 1), dtype=np.int32)
    run = trainer(args, attention, length)
    run.fit(tokens[:, :-1], tokens[:, 1:], batch_size=1, epochs=1, verbose=0)
    start = time.perf_counter()
    history = run.fit(tokens[:, :-1], tokens[:, 1:], batch_size=1, epochs=1, verbose=0)
    seconds = (time.perf_counter() - start) / 3
    loss = history.history["loss"][-1]
    assert np.isfinite(loss), f"{attention} at {length}: loss {loss}"
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--start", type=int, default=2048, help="the first length compiled")
    parser.add_argument("--step", type=int, default=1024, help="lengths are multiples of this")
    parser.add_argument("--max-length", type=int, default=131072)
    parser.add_argument("--limit-bytes", type=float, default=0.0, help="a memory limit (default: the device's)")
    parser.add_argument("--attention", nargs="+", default=["xla", "pallas"])
    parser.add_argument("--target", default=None, help='compile for one chip of absent devices ("tpu v5e:2x2")')
    parser.add_argument("--time-at", type=int, default=0, help="only time a step of each attention at this length")
    args = parser.parse_args()
    device = jax.devices()[0]
    if args.time_at:  # the model's whole train step, kernel against XLA attention
        seconds = {attention: runs(args, attention, args.time_at) for attention in args.attention}
        print(", ".join(f"{a}: {s * 1e3:.1f} ms a step" for a, s in seconds.items()), flush=True)
        if "xla" in seconds and "pallas" in seconds:
            ratio = seconds["xla"] / seconds["pallas"]
            print(f"kernel / xla at {args.time_at:,} tokens: {ratio:.2f}x the steps a second")
        return
    print(f"jax {jax.__version__}, {device.platform} {device.device_kind}: {args.layers} x {args.d_model}, batch 1")
    found: dict[str, int] = {}
    for attention in args.attention:
        found[attention] = longest(args, attention)
        print(f"{attention}: {found[attention]:,} tokens fit", flush=True)
        if found[attention] and not args.target:
            seconds = runs(args, attention, found[attention])
            print(f"{attention}: steps at {found[attention]:,} tokens ran ({seconds * 1e3:.0f} ms a step)", flush=True)
    if found.get("xla"):
        print(f"kernel / xla: {found.get('pallas', 0) / found['xla']:.2f}x the length")
    print(json.dumps(found))


if __name__ == "__main__":
    main()
