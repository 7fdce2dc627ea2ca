"""The plan's step-time estimate against the real step on several byte LMs (issue #80 item 6), in one
process on one chip: per configuration the compiled step's cost (flops, bytes accessed, and on a TPU
the cycles its compiler estimates, as the step runs them: ``planning.compiler_cycles``), the plan's
estimate from them (``planning.plan.estimate_seconds``) and its ratio to the real step (the mean of five after
a warm-up fit), and with ``--out`` the compiled text and the device's time per executed op (a
``jax.profiler`` trace of three steps) for reading offline; first, the chip's rates as
microbenchmarks measure them (a large matmul in bf16 and float32, a large elementwise pass).

    python benchmarks/plan_check.py --out /tmp/plans                  # on the chip: the six of #80
    python benchmarks/plan_check.py --small                           # a smoke test on a CPU
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import optax

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
import lm_mfu  # noqa: E402
import step_phases  # noqa: E402
from lm import ByteLM  # noqa: E402

import trainkit as tk  # noqa: E402
from trainkit.planning import plan  # noqa: E402
from trainkit.planning.compiler_cycles import executed_cycles  # noqa: E402

#: (name, layers, d_model, length, batch, precision, remat): #80's six, then two it did not name
CONFIGS = (
    ("8x768 b32 bf16", 8, 768, 512, 32, "bf16", False),
    ("12x1024 b32 bf16", 12, 1024, 512, 32, "bf16", False),
    ("12x1024 b64 bf16", 12, 1024, 512, 64, "bf16", False),
    ("12x1024 b128 bf16 remat", 12, 1024, 512, 128, "bf16", True),
    ("12x1024 len2048 b8 bf16 (kernel)", 12, 1024, 2048, 8, "bf16", False),
    ("8x768 b16 fp32", 8, 768, 512, 16, "fp32", False),
    ("4x512 len1024 b16 bf16", 4, 512, 1024, 16, "bf16", False),
    ("12x1024 b32 bf16 remat", 12, 1024, 512, 32, "bf16", True),
)
SMALL = (("2x64 b8 fp32", 2, 64, 64, 8, "fp32", False), ("2x64 b8 bf16 remat", 2, 64, 64, 8, "bf16", True))


def timed(function, *args, repeats: int = 10) -> float:
    jax.block_until_ready(function(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = function(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def rates(n: int) -> dict[str, float]:
    """flop/s of an n x n x n matmul in bf16 and in float32 (the default precision), bytes/s of ``2 * x + 1``."""
    found = {}
    for name, dtype in (("matmul_bf16", jnp.bfloat16), ("matmul_fp32", jnp.float32)):
        a = jnp.ones((n, n), dtype)
        found[name] = 2 * n**3 / timed(jax.jit(lambda a: a @ a), a)
    x = jnp.ones((n * n * 4,), jnp.float32)
    found["bandwidth"] = 2 * x.nbytes / timed(jax.jit(lambda x: 2 * x + 1), x)
    return found


def trainer_for(layers: int, d_model: int, length: int, precision: str, remat: bool) -> tk.Trainer:
    """The byte LM (``examples/lm.py``), its attention by ``tk.attention`` (the kernel on a TPU) from 2,048 tokens."""
    model = ByteLM(layers=layers, d_model=d_model, heads=max(1, d_model // 64), mlp=4 * d_model, max_len=length,
                   jax_attention=length >= 2048)  # fmt: skip
    return tk.Trainer(model, loss="sparse_categorical_crossentropy", optimizer=optax.adamw(1e-4), strategy="single",
                      precision=precision, remat=["Block"] if remat else None)  # fmt: skip


def check(config: tuple, out: pathlib.Path | None, steps: int = 5) -> dict:
    name, layers, d_model, length, batch, precision, remat = config
    trainer = trainer_for(layers, d_model, length, precision, remat)
    x, y = lm_mfu.batches(steps, batch, length)
    trainer.fit((x[:batch], y[:batch]), batch_size=batch, epochs=1, verbose=0)  # built and compiled
    compiled = tk.debug.lower_train_step(trainer).compile()
    cost, text = compiled.cost_analysis(), compiled.as_text()
    start = time.perf_counter()
    trainer.fit((x, y), batch_size=batch, epochs=1, verbose=0, shuffle=False)
    jax.block_until_ready(trainer.state)
    real = (time.perf_counter() - start) / steps
    flops, moved, cycles = float(cost.get("flops", 0)), float(cost.get("bytes accessed", 0)), executed_cycles(text)
    estimated = plan.estimate_seconds(flops, moved, 0.0, jax.devices()[:1], cycles)  # the plan's, on one device
    found = {"name": name, "flops": flops, "bytes_accessed": moved, "compiler_cycles": cycles, "real": real,
             "estimated": estimated, "ratio": estimated / real}  # fmt: skip
    if out is not None:
        slug = "".join(c if c.isalnum() else "_" for c in name)
        (out / f"{slug}.hlo.txt").write_text(text)
        folder = tempfile.mkdtemp(prefix="plan-check-")
        with jax.profiler.trace(folder):
            trainer.fit((x[: 3 * batch], y[: 3 * batch]), batch_size=batch, epochs=1, verbose=0, shuffle=False)
            jax.block_until_ready(trainer.state)
        times = step_phases.device_times(folder, jax.devices()[0].platform != "cpu")
        (out / f"{slug}.op_micros.json").write_text(json.dumps({op: t / 3 for op, t in times.items()}))
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", default=None, help="a folder for each configuration's compiled text and op times")
    parser.add_argument("--only", type=int, nargs="+", default=None, help="these configurations (indices)")
    args = parser.parse_args()
    out = None if args.out is None else pathlib.Path(args.out)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    configs = SMALL if args.small else CONFIGS
    chosen = configs if args.only is None else [configs[i] for i in args.only]
    measured = rates(256 if args.small else 8192)
    print(json.dumps({"rates": measured}), flush=True)
    for config in chosen:
        found = check(config, out)
        print(json.dumps(found), flush=True)
        if out is not None:
            with open(out / "plan_check.jsonl", "a") as file:
                file.write(json.dumps(found | {"rates": measured}) + "\n")


if __name__ == "__main__":
    main()
