"""Start-up: seconds from creating the ``Trainer`` to the end of the first training step, for an
MLP, a CNN and a small transformer LM, under an explicit strategy and under ``"auto"``, with a
cold and a warm persistent compilation cache. Each figure is one fresh process (the median of
``--repeats``); cold runs start from an empty cache directory, warm runs reuse the one the cold
run filled (the last column: a warm run with another seed, which finds every program too).
Reported as ratios inside each model's row, from one run.

    python benchmarks/startup.py [--repeats 3] [--devices 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = "--child"


def child(model: str, strategy: str, devices: int, seed: int) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import flax.linen as nn
    import numpy as np
    import optax
    from models import CNN, TransformerLM

    import trainkit as tk

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(nn.relu(nn.Dense(512)(nn.relu(nn.Dense(512)(x)))))

    rng = np.random.default_rng(0)
    if model == "mlp":
        module, x, y = MLP(), rng.normal(size=(128, 784)).astype(np.float32), rng.integers(0, 10, 128)
        loss = "sparse_categorical_crossentropy"
    elif model == "cnn":
        module, x, y = CNN(), rng.normal(size=(64, 28, 28, 1)).astype(np.float32), rng.integers(0, 10, 64)
        loss = "sparse_categorical_crossentropy"
    else:
        module = TransformerLM(vocab=1024, d_model=128, heads=4, layers=2, mlp=512)
        tokens = rng.integers(0, 1024, size=(16, 65))
        x, y, loss = tokens[:, :-1], tokens[:, 1:], "sparse_categorical_crossentropy"
    created = time.perf_counter()
    trainer = tk.Trainer(module, loss=loss, optimizer=optax.adam(1e-3), strategy=strategy, seed=seed)
    first: list[float] = []
    clock = tk.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs=None: first.append(time.perf_counter()) if not first else None
    )
    trainer.fit((x, y), batch_size=len(x), epochs=1, verbose=0, callbacks=[clock])
    print(json.dumps({"seconds": first[0] - created, "strategy": trainer.strategy.describe()}))


def measure(model: str, strategy: str, devices: int, cache: str, seed: int = 0) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(TRAINKIT_COMPILATION_CACHE=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    out = subprocess.run(
        [sys.executable, __file__, CHILD, model, strategy, str(devices), str(seed)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


#: the strategy names of the Trainer for what ``describe()`` prints
SHORT = {"SingleDevice": "single", "DataParallel": "dp", "FSDP": "fsdp"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    fixed = {"mlp": "dp", "cnn": "dp", "lm": "fsdp"}  # the explicit strategies of the earlier tables
    print(
        f'| model | "auto" picks | its pick explicit, cold (s) | "auto" cold / its pick explicit cold '
        f'| "auto" warm / its pick explicit warm | fixed explicit, cold (s) | "auto" cold / fixed cold '
        f"| fixed explicit, warm / cold | fixed warm, another seed / warm |  ({args.devices} fake CPU devices)"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for model, strategy in fixed.items():
        figures: dict[str, list[float]] = {}
        picked = ""
        for _ in range(args.repeats):  # alternating: "auto", then its pick explicit, then the fixed strategy
            for label in ("auto", "pick", "fixed"):
                name = {"auto": "auto", "pick": SHORT[picked.split("(")[0]] if picked else "", "fixed": strategy}[label]
                directory = tempfile.mkdtemp(prefix="trainkit-cache-")
                cold = measure(model, name, args.devices, directory)
                warm = measure(model, name, args.devices, directory)
                figures.setdefault(f"{label}/cold", []).append(cold["seconds"])
                figures.setdefault(f"{label}/warm", []).append(warm["seconds"])
                if label == "fixed":
                    reseeded = measure(model, name, args.devices, directory, seed=1)
                    figures.setdefault("fixed/reseeded", []).append(reseeded["seconds"])
                picked = cold["strategy"] if label == "auto" else picked
        m = {k: statistics.median(v) for k, v in figures.items()}
        print(
            f"| {model} | {picked} | {m['pick/cold']:.2f} | **{m['auto/cold'] / m['pick/cold']:.2f}** "
            f"| **{m['auto/warm'] / m['pick/warm']:.2f}** | {m['fixed/cold']:.2f} ({strategy}) "
            f"| {m['auto/cold'] / m['fixed/cold']:.2f} | {m['fixed/warm'] / m['fixed/cold']:.2f} "
            f"| {m['fixed/reseeded'] / m['fixed/warm']:.2f} |"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
