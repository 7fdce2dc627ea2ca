"""The checks a lent GPU is for, in one run, printed as one table of ratios (``gpu_suite.sh``
runs it; ``--small`` shrinks every size for a smoke test on CPU):

- MFU of ``examples/lm.py``'s model: trainkit against a hand-written jitted loop, bf16 and fp32;
- step overhead on a small CNN: trainkit against the hand-written loop;
- remat's memory saving: the compiled train step's temporaries with ``remat="full"`` over none;
- ``deterministic=True``: two fresh processes, bit for bit (and how far two runs without it
  drift), and its cost in steps/s;
- export round trips: each format's outputs against ``predict`` on the device.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import optax

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
import lm_mfu  # noqa: E402
from lm import ByteLM  # noqa: E402
from models import CNN  # noqa: E402
from timing import measure  # noqa: E402

import trainkit as tk  # noqa: E402
from trainkit.monitoring import throughput  # noqa: E402


def sizes(small: bool) -> dict:
    if small:
        return {"lm": (2, 64, 64, 8), "steps": 4, "repeats": 2, "cnn_batch": 32, "det": (2, 64, 64, 8, 6)}
    return {"lm": (8, 768, 512, 32), "steps": 20, "repeats": 5, "cnn_batch": 256, "det": (4, 256, 256, 16, 30)}


def lm_model(layers, d_model, length):
    return ByteLM(layers=layers, d_model=d_model, heads=max(1, d_model // 64), mlp=4 * d_model, max_len=length)


def lm_trainer(layers, d_model, length, **options) -> tk.Trainer:
    """examples/lm.py's model on one device with AdamW (``options``: remat, deterministic)."""
    model = lm_model(layers, d_model, length)
    return tk.Trainer(
        model, loss="sparse_categorical_crossentropy", optimizer=optax.adamw(1e-3), strategy="single", **options
    )


def mfu_rows(size: dict) -> list[tuple]:
    layers, d_model, length, batch = size["lm"]
    model, rows = lm_model(layers, d_model, length), []
    x, y = lm_mfu.batches(size["steps"], batch, length)
    for precision in ("bf16", "fp32"):
        trainer, fit = lm_mfu.trainkit_run(model, x, y, batch, precision)
        rates = measure(
            {"hand": lm_mfu.hand_written_run(model, x, y, batch, precision), "tk": fit}, size["steps"], size["repeats"]
        )
        flops, peak = tk.debug.step_flops(trainer), throughput.peak_flops(jax.devices()[0].device_kind, precision)
        mfu = (
            ""
            if flops is None or peak is None
            else f"MFU {flops * rates['tk'] / peak:.1%} (hand-written {flops * rates['hand'] / peak:.1%})"
        )
        rows.append((f"LM {precision}: trainkit / hand-written steps/s", rates["tk"] / rates["hand"], ">= 0.97", mfu))
    return rows


def overhead_row(size: dict) -> tuple:
    batch, steps = size["cnn_batch"], size["steps"] * 3
    rng = np.random.default_rng(0)
    x, y = rng.random((steps * batch, 28, 28, 1), np.float32), rng.integers(0, 10, steps * batch).astype(np.int32)
    _, fit = lm_mfu.trainkit_run(CNN(), x, y, batch, "fp32")
    rates = measure({"hand": lm_mfu.hand_written_run(CNN(), x, y, batch, "fp32"), "tk": fit}, steps, size["repeats"])
    return (
        "CNN fp32: trainkit / hand-written steps/s",
        rates["tk"] / rates["hand"],
        ">= 0.97",
        f"{rates['tk']:.0f} steps/s",
    )


def remat_row(size: dict) -> tuple:
    layers, d_model, length, batch = size["lm"]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (batch, length + 1)).astype(np.int32)
    temp = {}
    for remat in (None, "full"):
        trainer = lm_trainer(layers, d_model, length, remat=remat)
        plan = trainer.plan((tokens[:, :-1], tokens[:, 1:]), candidates=[tk.SingleDevice()], verbose=0)
        temp[remat] = plan.rows[0].temp_bytes
    return (
        "LM remat='full': temp bytes / no remat",
        temp["full"] / temp[None],
        "< 1",
        f"{temp[None] / 2**20:.0f} MiB without",
    )


def determinism_run(out: str, deterministic: bool, small: bool) -> None:
    """One fresh process's run (called by :func:`determinism_row` in a subprocess)."""
    layers, d_model, length, batch, steps = sizes(small)["det"]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (batch * steps, length + 1)).astype(np.int32)
    trainer = lm_trainer(layers, d_model, length, deterministic=deterministic)
    trainer.fit(tokens[:, :-1], tokens[:, 1:], batch_size=batch, epochs=1, verbose=0)  # compile and warm up
    start = time.perf_counter()
    trainer.fit(tokens[:, :-1], tokens[:, 1:], batch_size=batch, epochs=1, verbose=0)
    jax.block_until_ready(trainer.state)
    rate = steps / (time.perf_counter() - start)
    leaves = jax.tree.leaves(trainer.params)
    np.savez(out, rate=rate, **{str(i): np.asarray(leaf, np.float32) for i, leaf in enumerate(leaves)})


def determinism_rows(small: bool) -> list[tuple]:
    if jax.devices()[0].platform == "tpu":  # its fresh processes would open the chip this one holds
        return [("deterministic=True: two fresh processes", float("nan"), "equal", "skipped: a TPU admits one process")]
    folder, runs = tempfile.mkdtemp(), {}
    env = {**os.environ, "TRAINKIT_COMPILATION_CACHE": "off"}
    for deterministic in (True, False):
        for i in range(2):
            out = os.path.join(folder, f"{deterministic}{i}.npz")
            command = [sys.executable, __file__, "--determinism-run", out] + (
                ["--nondeterministic"] if not deterministic else []
            )
            command += ["--small"] if small else []
            subprocess.run(command, check=True, env=env)
            with np.load(out) as data:
                runs[deterministic, i] = {k: data[k] for k in data.files}

    def drift(flag):
        a, b = runs[flag, 0], runs[flag, 1]
        return max(float(np.max(np.abs(a[k] - b[k]))) for k in a if k != "rate")

    cost = float(
        np.mean([runs[True, i]["rate"] for i in range(2)]) / np.mean([runs[False, i]["rate"] for i in range(2)])
    )
    return [
        ("deterministic=True: max abs param diff of 2 runs", drift(True), "== 0", f"without it: {drift(False):.3g}"),
        ("deterministic=True: steps/s / default", cost, "(its cost)", ""),
    ]


def export_rows(size: dict) -> list[tuple]:
    layers, d_model, length, batch = sizes(True)["lm"]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (64, length + 1)).astype(np.int32)
    trainer = lm_trainer(layers, d_model, length)
    trainer.fit(tokens[:, :-1], tokens[:, 1:], batch_size=8, epochs=1, verbose=0)
    x = tokens[:5, :-1]
    expected = trainer.predict(x, batch_size=8)
    folder, rows = tempfile.mkdtemp(), []
    for fmt, name, needs in (
        ("jax", "m.jax", None),
        ("tf_saved_model", "sm", "tensorflow"),
        ("onnx", "m.onnx", "onnxruntime"),
    ):
        if needs and importlib.util.find_spec(needs) is None:
            rows.append((f"export {fmt}: max abs diff vs predict", float("nan"), "<= 1e-4", f"{needs} not installed"))
            continue
        path = os.path.join(folder, name)
        try:
            trainer.export(path, format=fmt, verbose=False)
        except (ImportError, RuntimeError) as error:
            rows.append((f"export {fmt}: max abs diff vs predict", float("nan"), "<= 1e-4", str(error)[:60]))
            continue
        if fmt == "jax":
            got = np.asarray(tk.export.load(path)(x))
        elif fmt == "tf_saved_model":
            import tensorflow as tf

            loaded = tf.saved_model.load(path)
            got = loaded.serve(x).numpy()
        else:
            import onnxruntime

            got = onnxruntime.InferenceSession(path).run(None, {"input": x})[0]
        rows.append((f"export {fmt}: max abs diff vs predict", float(np.max(np.abs(got - expected))), "<= 1e-4", ""))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="tiny sizes: a smoke test on CPU")
    parser.add_argument("--determinism-run", default="", help=argparse.SUPPRESS)
    parser.add_argument("--nondeterministic", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.determinism_run:
        return determinism_run(args.determinism_run, not args.nondeterministic, args.small)
    size, start = sizes(args.small), time.perf_counter()
    device = jax.devices()[0]
    rows = []
    for measured in (lambda: mfu_rows(size), lambda: [overhead_row(size), remat_row(size)],
                     lambda: determinism_rows(args.small), lambda: export_rows(size)):  # fmt: skip
        for row in measured():  # each row as it is measured: a run cut short still shows what it measured
            rows.append(row)
            print(f"| {row[0]} | {row[1]:.4g} | {row[2]} | {row[3]} |", flush=True)
    print(
        f"\njax {jax.__version__}, {device.platform} {device.device_kind}, {'small' if args.small else 'full'} sizes, "
        f"{time.perf_counter() - start:.0f} s"
    )
    print("| check | ratio / value | target | notes |\n|---|---|---|---|")
    for name, value, target, notes in rows:
        print(f"| {name} | {value:.4g} | {target} | {notes} |")
    print(json.dumps({name: value for name, value, _, _ in rows}))


if __name__ == "__main__":
    main()
