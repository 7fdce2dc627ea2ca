"""The checks issue #68 asks of trainkit on one TPU chip, in ONE process (the chip admits one: no
subprocess opens it here), each row printed as it is measured, then the table and one JSON line:

- the dispatch-bound MLP (``benchmarks/steps_per_execution.py``'s 32-64-10, batch 32): k=1 against
  a hand-written jit loop (target >= 0.95), k=32 against a hand-written ``lax.scan`` of 32 steps
  (>= 0.90), paired ratios of alternating rounds;
- a fresh 1,024-step fit end to end, compiles included (the persistent cache off): the default k's
  seconds over the better of k=1 and k=32 (<= 1.15);
- ``examples/lm.py``'s model (8 x 768, length 512, batch 32, AdamW) in bf16: trainkit over a
  hand-written jit loop (>= 0.98), with its MFU (the model's own flops) and HFU (the compiler's);
- the plan's step-time estimate over the real step, the 12 x 1,024 LM at batch 128 with remat of
  its blocks (within 0.7-1.3);
- ``offload="optimizer"``'s step over the step without it, the 12 x 1,024 LM at batch 32 (<= 1.25);
- the named out-of-memory error of the 12 x 1,024 LM at batch 512, its text printed;
- #83's packed rows (``segment_ids``) through the kernel against XLA's masked attention at 8,192 tokens
  (>= 3x), and grouped heads' attention memory against heads repeated in the step (<= 0.5).

    source .whl-tpu/install.sh && python3 benchmarks/tpu_suite.py      # on the chip
    python3 benchmarks/tpu_suite.py --only attention_row               # one row (a function's name)
    python benchmarks/tpu_suite.py --small                              # a smoke test on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
import lm_mfu  # noqa: E402
import steps_per_execution as spe  # noqa: E402
from lm import ByteLM  # noqa: E402
from timing import measure, measure_rounds, paired_ratio  # noqa: E402

import trainkit as tk  # noqa: E402
from trainkit.distributed import compile_cache  # noqa: E402
from trainkit.monitoring import throughput  # noqa: E402

Row = tuple[str, float, str, str]


def sizes(small: bool) -> dict:
    if small:
        return {"dispatch": 256, "repeats": 2, "fresh": 256, "mfu": (2, 64, 64, 8), "big": (2, 128, 64), "oom": 64}
    return {"dispatch": 2048, "repeats": 5, "fresh": 1024, "mfu": (8, 768, 512, 32), "big": (12, 1024, 512),
            "oom": 512}  # fmt: skip


def dispatch_rows(size: dict, k: int = 32, wide: int = 128) -> list[Row]:
    """#80 rows 1-3: k=1 against a jit loop, k=32 and k=128 against scans of as many steps that ship
    their slices, and k=32 with the epoch's rows kept on the chip (``data_on_device=True``) against
    the scan of 32 (target >= 1.5: the host then sends only row indices)."""
    x, y = spe.dataset(size["dispatch"])
    contenders = {
        "jit": spe.hand_written(x, y, 1),
        "k=1": spe.trainkit_fit(x, y, 1),
        "scan": spe.hand_written(x, y, k),
        f"k={k}": spe.trainkit_fit(x, y, k),
        f"scan {wide}": spe.hand_written(x, y, wide),
        f"k={wide}": spe.trainkit_fit(x, y, wide),
        "on device": spe.trainkit_fit(x, y, k, data_on_device=True),
    }
    rounds = measure_rounds(contenders, size["dispatch"], size["repeats"])
    rate = {name: float(np.median(r)) for name, r in rounds.items()}

    def row(ours: str, theirs: str, label: str, target: str) -> Row:
        notes = f"{rate[ours]:.0f} vs {rate[theirs]:.0f} steps/s"
        return (label, paired_ratio(rounds, ours, theirs), target, notes)

    return [
        row("k=1", "jit", "k=1 / jit loop", ">= 0.95"),
        row(f"k={k}", "scan", f"k={k} / lax.scan of {k}", ">= 0.90"),
        row(f"k={wide}", f"scan {wide}", f"k={wide} / lax.scan of {wide}", ">= 0.90"),
        row("on device", "scan", f"k={k}, data_on_device / lax.scan of {k}", ">= 1.5"),
    ]


def fresh_fit_row(size: dict) -> Row:
    """One fit of ``size["fresh"]`` steps end to end, fresh trainers, the compilation cache off."""
    os.environ[compile_cache.ENVIRONMENT] = "off"
    x, y = spe.dataset(size["fresh"])
    spe.make_trainer(1).fit((x[:64], y[:64]), batch_size=spe.BATCH, epochs=1, verbose=0)  # the process's first costs
    seconds, picked = {}, {}
    for k in (1, 32, None):
        trainer = spe.make_trainer(k)
        start = time.perf_counter()
        trainer.fit((x, y), batch_size=spe.BATCH, epochs=1, verbose=0)
        seconds[k], picked[k] = time.perf_counter() - start, trainer.steps_per_execution
    best = min(seconds[1], seconds[32])
    notes = f"default {seconds[None]:.2f} s (k={picked[None]}), k=1 {seconds[1]:.2f} s, k=32 {seconds[32]:.2f} s"
    return (f"default k, fresh {size['fresh']}-step fit / the better", seconds[None] / best, "<= 1.15", notes)


def lm(layers: int, d_model: int, length: int) -> ByteLM:
    return ByteLM(layers=layers, d_model=d_model, heads=max(1, d_model // 64), mlp=4 * d_model, max_len=length)


def mfu_row(size: dict) -> Row:
    layers, d_model, length, batch = size["mfu"]
    model, steps = lm(layers, d_model, length), 10
    x, y = lm_mfu.batches(steps, batch, length)
    trainer, ours = lm_mfu.trainkit_run(model, x, y, batch, "bf16")
    rates = measure({"hand": lm_mfu.hand_written_run(model, x, y, batch, "bf16"), "trainkit": ours}, steps, 3)
    peak = throughput.peak_flops(jax.devices()[0].device_kind, "bf16")
    model, hardware = tk.debug.model_step_flops(trainer), tk.debug.step_flops(trainer)  # MFU's and HFU's counts
    mfu = (
        "no peak known"
        if peak is None or model is None or hardware is None
        else f"MFU {model * rates['trainkit'] / peak:.1%} (HFU {hardware * rates['trainkit'] / peak:.1%})"
    )
    notes = f"{1e3 / rates['trainkit']:.1f} vs {1e3 / rates['hand']:.1f} ms/step, {mfu}"
    return (f"LM {layers}x{d_model} bf16 / jit loop", rates["trainkit"] / rates["hand"], ">= 0.98", notes)


def big_trainer(size: dict, **options) -> tk.Trainer:
    layers, d_model, length = size["big"]
    return tk.Trainer(lm(layers, d_model, length), loss="sparse_categorical_crossentropy", optimizer=optax.adamw(1e-4),
                      strategy="single", precision="bf16", **options)  # fmt: skip


def step_seconds(trainer: tk.Trainer, batch: int, length: int, steps: int = 5) -> float:
    """The median step of ``steps`` after a warm-up fit (the compile)."""
    x, y = lm_mfu.batches(steps, batch, length)
    trainer.fit((x[:batch], y[:batch]), batch_size=batch, epochs=1, verbose=0)
    start = time.perf_counter()
    trainer.fit((x, y), batch_size=batch, epochs=1, verbose=0, shuffle=False)
    jax.block_until_ready(trainer.state)
    return (time.perf_counter() - start) / steps


def plan_row(size: dict, batch: int = 128) -> Row:
    length = size["big"][2]
    x, y = lm_mfu.batches(1, batch, length)
    trainer = big_trainer(size, remat=["Block"])
    estimated = trainer.plan((x, y), candidates=[tk.SingleDevice()], verbose=0).rows[0].estimated_seconds
    real = step_seconds(trainer, batch, length)
    notes = f"{estimated * 1e3:.1f} vs {real * 1e3:.1f} ms"
    return ("plan's estimate / real step", estimated / real, "0.7 - 1.3", notes)


def offload_row(size: dict, batch: int = 32) -> Row:
    length = size["big"][2]
    plain = step_seconds(big_trainer(size), batch, length)
    offloaded = step_seconds(big_trainer(size, offload="optimizer"), batch, length)
    notes = f"{offloaded * 1e3:.1f} vs {plain * 1e3:.1f} ms"
    return ("offload='optimizer' / none", offloaded / plain, "<= 1.25", notes)


def out_of_memory_row(size: dict) -> Row:
    batch, length = size["oom"], size["big"][2]
    x, y = lm_mfu.batches(1, batch, length)
    if jax.devices()[0].platform == "cpu":  # a smoke test: the chip's memory rehearsed
        os.environ["TRAINKIT_DEVICE_MEMORY"] = "16MiB"
    try:
        big_trainer(size).fit((x, y), batch_size=batch, epochs=1, verbose=0)
    except tk.OutOfMemory as error:
        print(f"the named error:\n{error}")
        return (f"out of memory at batch {batch}: fits at", float(error.fits_at or 0), "named", str(error.measure))
    finally:
        os.environ.pop("TRAINKIT_DEVICE_MEMORY", None)
    return (f"out of memory at batch {batch}", 0.0, "named", "it fitted: no error to name")


def attention_row(size: dict, steps: int = 10) -> Row:
    """#71: ``tk.attention``'s Pallas kernel against XLA's attention, forward and backward of a causal
    call at length 2,048 in bf16 (4 rows, 8 heads of 128): steps per second, kernel over XLA."""
    if jax.devices()[0].platform != "tpu":
        return ("attention kernel / xla at 2,048 (rate)", 0.0, ">= 1", "skipped: the kernel runs on a TPU")
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(4, 2048, 8, 128)), jnp.bfloat16) for _ in range(3))

    def contender(implementation: str):
        def loss(*qkv):
            return (tk.attention(*qkv, causal=True, implementation=implementation).astype(jnp.float32) ** 2).mean()

        gradients = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return lambda: [jax.block_until_ready(gradients(q, k, v)) for _ in range(steps)] and None

    rounds = measure_rounds({"pallas": contender("pallas"), "xla": contender("xla")}, steps, size["repeats"])
    ratio = paired_ratio(rounds, "pallas", "xla")
    return ("attention kernel / xla at 2,048 (rate)", ratio, ">= 1", f"{len(rounds['xla'])} paired rounds")


def packed_row(size: dict, steps: int = 5) -> Row:
    """#83: packed documents at 8,192 tokens (2 rows, 8 heads of 128, bf16), forward and backward: the kernel
    with ``segment_ids`` against XLA's attention under the same mask (target >= 3x its steps a second)."""
    if jax.devices()[0].platform != "tpu":
        return ("packed rows kernel / xla masked at 8,192 (rate)", 0.0, ">= 3", "skipped: the kernel runs on a TPU")
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 8192, 8, 128)), jnp.bfloat16) for _ in range(3))
    ids = jnp.asarray(np.cumsum(rng.random((2, 8192)) < 1 / 1500, axis=1) + 1, jnp.int32)  # ~1,500-token documents

    def contender(implementation: str):
        def loss(*qkv):
            out = tk.attention(*qkv, causal=True, segment_ids=ids, implementation=implementation)
            return (out.astype(jnp.float32) ** 2).mean()

        gradients = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return lambda: [jax.block_until_ready(gradients(q, k, v)) for _ in range(steps)] and None

    rounds = measure_rounds({"pallas": contender("pallas"), "xla": contender("xla")}, steps, size["repeats"])
    ratio = paired_ratio(rounds, "pallas", "xla")
    return ("packed rows kernel / xla masked at 8,192 (rate)", ratio, ">= 3", f"{len(rounds['xla'])} paired rounds")


def grouped_row(size: dict) -> Row:
    """#83: grouped heads (8 query heads over 2 key and value heads) through the kernel against the same 2 heads
    repeated to 8 in the step (``jnp.repeat``, as a port without grouped heads does): the compiled forward and
    backward's arguments and temporaries (<= 0.5). The same figures compile for a v5e target on a CPU."""
    if jax.devices()[0].platform != "tpu":
        return ("grouped / repeated heads, attention memory", 0.0, "<= 0.5", "skipped: the kernel runs on a TPU")
    shape = jax.ShapeDtypeStruct

    def memory(repeat: bool) -> tuple[float, float]:
        def loss(q, k, v):
            if repeat:
                k, v = jnp.repeat(k, 4, axis=2), jnp.repeat(v, 4, axis=2)
            return (tk.attention(q, k, v, causal=True).astype(jnp.float32) ** 2).mean()

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        kv = shape((4, 8192, 2, 128), jnp.bfloat16)
        compiled = grad.lower(shape((4, 8192, 8, 128), jnp.bfloat16), kv, kv).compile()
        memory = compiled.memory_analysis()
        return float(memory.temp_size_in_bytes), float(memory.argument_size_in_bytes)

    (grouped, arguments), (repeated, _) = memory(False), memory(True)
    ratio = (grouped + arguments) / (repeated + arguments)
    notes = f"temporaries {grouped / 2**20:.0f} vs {repeated / 2**20:.0f} MiB, arguments {arguments / 2**20:.0f} MiB"
    return ("grouped / repeated heads, attention memory", ratio, "<= 0.5", notes)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="tiny sizes: a smoke test on CPU")
    parser.add_argument("--only", nargs="+", default=None, help="these rows' functions only, e.g. attention_row")
    args = parser.parse_args()
    size, start, device = sizes(args.small), time.perf_counter(), jax.devices()[0]
    print(f"jax {jax.__version__}, {device.platform} {device.device_kind}, {'small' if args.small else 'full'} sizes")
    rows: list[Row] = []
    singles = (fresh_fit_row, mfu_row, plan_row, offload_row, out_of_memory_row, attention_row, packed_row, grouped_row)
    chosen = [dispatch_rows, *singles] if args.only is None else [globals()[name] for name in args.only]
    for one in chosen:
        began = time.perf_counter()
        for row in one(size) if one is dispatch_rows else [one(size)]:
            rows.append(row)
            print(f"| {row[0]} | {row[1]:.4g} | {row[2]} | {row[3]} |", flush=True)
        print(f"({one.__name__}: {time.perf_counter() - began:.0f} s)", flush=True)  # the 10-minute budget's shares
    print(f"\n{time.perf_counter() - start:.0f} s\n| check | ratio / value | target | notes |\n|---|---|---|---|")
    for name, value, target, notes in rows:
        print(f"| {name} | {value:.4g} | {target} | {notes} |")
    print(json.dumps({name: value for name, value, _, _ in rows}))


if __name__ == "__main__":
    main()
