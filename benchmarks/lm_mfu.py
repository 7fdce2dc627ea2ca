"""MFU of the byte-level LM (``examples/lm.py``) on one device: trainkit ``SingleDevice`` against
a hand-written jitted optax loop with the same model, optimizer, precision and batches.

Both run the same number of steps after a warm-up, alternating, medians of ``--repeats``; the
flops of one step come from the compiled step's cost analysis (``tk.debug.step_flops``), the
peak from ``trainkit.core.chips.CHIPS`` (none on CPU: then only tokens/s and the ratio).
Target on a GPU: trainkit >= 0.97x the hand-written loop.

    python benchmarks/lm_mfu.py --layers 8 --d-model 512 --length 512 --batch-size 32 --precision bf16
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from lm import ByteLM  # noqa: E402

import trainkit as tk  # noqa: E402
from trainkit.monitoring import throughput  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from timing import measure  # noqa: E402


def batches(count: int, batch_size: int, length: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(count * batch_size, length + 1)).astype(np.int32)
    return data[:, :-1], data[:, 1:]


def optimizer():
    return optax.adamw(1e-3, weight_decay=0.01)


def trainkit_run(model, x, y, batch_size, precision):
    trainer = tk.Trainer(
        model, loss="sparse_categorical_crossentropy", optimizer=optimizer(), strategy="single", precision=precision
    )
    trainer.fit((x[:batch_size], y[:batch_size]), batch_size=batch_size, epochs=1, verbose=0)  # compile

    def run():
        trainer.fit((x, y), batch_size=batch_size, epochs=1, verbose=0, shuffle=False)
        jax.block_until_ready(trainer.state)

    return trainer, run


def hand_written_run(model, x, y, batch_size, precision):
    compute = jnp.bfloat16 if precision == "bf16" else jnp.float32
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), x[:1])["params"])  # drop the axis names
    tx = optimizer()

    def loss_fn(params, xb, yb):
        cast = jax.tree.map(lambda p: p.astype(compute), params)
        logits = model.apply({"params": cast}, xb).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    @jax.jit
    def step(state, xb, yb):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    box = {"state": (params, tx.init(params))}
    box["state"], _ = step(box["state"], x[:batch_size], y[:batch_size])  # compile

    def run():
        state, pending = box["state"], []
        for lo in range(0, len(x), batch_size):
            state, loss = step(state, x[lo : lo + batch_size], y[lo : lo + batch_size])
            pending.append(loss)
            if len(pending) > 2:
                pending.pop(0).block_until_ready()
        jax.block_until_ready(state)
        box["state"] = state

    return run


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precision", default="fp32")
    args = parser.parse_args()
    model = ByteLM(
        layers=args.layers,
        d_model=args.d_model,
        heads=max(1, args.d_model // 64),
        mlp=4 * args.d_model,
        max_len=args.length,
    )
    x, y = batches(args.steps, args.batch_size, args.length)
    trainer, trainkit_fit = trainkit_run(model, x, y, args.batch_size, args.precision)
    contenders = {
        "hand-written jit": hand_written_run(model, x, y, args.batch_size, args.precision),
        "trainkit": trainkit_fit,
    }
    rates = measure(contenders, args.steps, args.repeats)
    device = jax.devices()[0]
    flops = tk.debug.step_flops(trainer)
    peak = throughput.peak_flops(device.device_kind, args.precision)
    tokens = args.batch_size * args.length
    print(
        f"jax {jax.__version__}, {device.device_kind}; ByteLM layers={args.layers} d_model={args.d_model} "
        f"length={args.length} batch={args.batch_size} {args.precision}; {trainer.count_params():,} parameters; "
        f"{args.steps} steps x {args.repeats} alternating repeats (medians)"
    )
    base = 1 / rates["hand-written jit"]
    for name, rate in rates.items():
        step = 1 / rate
        mfu = "" if peak is None or flops is None else f"  MFU {flops / step / peak:.1%}"
        print(f"{name:18} {step * 1e3:8.1f} ms/step  {tokens / step:12,.0f} tokens/s  {base / step:.3f}x{mfu}")


if __name__ == "__main__":
    os.environ.setdefault("TRAINKIT_COMPILATION_CACHE", "off")
    main()
