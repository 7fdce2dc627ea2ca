"""Export, find_batch_size and find_learning_rate, measured side by side in one run: each
finder's time as a multiple of one compile of the same train step, and each export format's
size and reload time (in a fresh process: what a server pays at start-up) against the jax one.

    JAX_NUM_CPU_DEVICES=8 python benchmarks/finders.py
"""

import importlib.util
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TRAINKIT_COMPILATION_CACHE", "off")  # every compile is a real one

import numpy as np  # noqa: E402
import optax  # noqa: E402

import trainkit as tk  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import CNN  # noqa: E402


def main():
    rng = np.random.default_rng(0)
    x, y = rng.random((512, 8, 8, 1), np.float32), rng.integers(0, 10, 512)
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    trainer = tk.Trainer(CNN(), loss="sparse_categorical_crossentropy", optimizer=optimizer, strategy="fsdp")

    start = time.perf_counter()
    trainer.plan((x, y), batch_size=64, candidates=[tk.FSDP()], verbose=0)
    one_compile = time.perf_counter() - start
    found = trainer.find_batch_size(x, y, memory_limit=64 * 2**20, max_batch_size=2**14, verbose=0)
    start = time.perf_counter()
    search = trainer.find_learning_rate(x, y, batch_size=64, steps=100)
    lr_seconds = time.perf_counter() - start
    print(f"one plan compile (FSDP, batch 64): {one_compile:.2f} s")
    print(f"find_batch_size: {found.seconds / one_compile:.2f}x one compile ({len(found.plans)} compiles; {found})")
    print(
        f"find_learning_rate, 100 steps: {lr_seconds / one_compile:.2f}x one compile "
        f"(suggestion {search.suggestion:.3g})"
    )

    folder = tempfile.mkdtemp()
    rows = []
    for fmt, name, needs in (
        ("jax", "m.jax", None),
        ("tf_saved_model", "sm", "tensorflow"),
        ("onnx", "m.onnx", "jax2onnx"),
    ):
        if needs and importlib.util.find_spec(needs) is None:
            continue
        path = os.path.join(folder, name)
        start = time.perf_counter()
        trainer.export(path, format=fmt, verbose=False)
        seconds = time.perf_counter() - start
        size = (
            sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
            if os.path.isdir(path)
            else os.path.getsize(path)
        )
        load = {
            "jax": f"import jax; e = jax.export.deserialize(bytearray(open({path!r}, 'rb').read())); e.call(x)",
            "tf_saved_model": f"import tensorflow as tf; m = tf.saved_model.load({path!r}); m.serve(x)",
            "onnx": f"import onnxruntime as o; s = o.InferenceSession({path!r}); s.run(None, {{'input': x}})",
        }[fmt]
        code = (
            "import time, numpy as np; x = np.ones((16, 8, 8, 1), np.float32); t = time.perf_counter(); "
            f"{load}; print(time.perf_counter() - t)"
        )
        env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=folder)
        reload_seconds = float(out.stdout.strip().splitlines()[-1])
        rows.append((fmt, size, seconds, reload_seconds))
    base = rows[0]
    print("| format | size vs jax | export time vs jax | reload + first call vs jax |")
    print("|---|---|---|---|")
    for fmt, size, seconds, reload_seconds in rows:
        print(
            f"| {fmt} | {size / base[1]:.2f} ({size / 1024:.0f} KiB) | {seconds / base[2]:.1f} "
            f"| {reload_seconds / base[3]:.1f} |"
        )


if __name__ == "__main__":
    main()
