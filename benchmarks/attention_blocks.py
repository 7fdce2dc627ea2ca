"""The splash kernel's block sizes against the fixed rule (issue #83 item 6): for each sequence length, head
size and causal or not, the forward and backward pass of one row of attention (8 heads, bf16) timed under each
block configuration that divides the length, against ``trainkit.attn.kernels.block_size``'s rule (the largest
of 512, 256 and 128 that divides the length, the same for every block). Prints a row per configuration and one
JSON line per shape: the best configuration, its time and the rule's. A configuration the chip cannot compile
(its blocks past the core's VMEM) is a row with the error. This is the measurement behind a table of block sizes
by length and head size; until it has run on a chip, ``tk.attention`` keeps the rule.

    source .whl-tpu/install.sh && python3 benchmarks/attention_blocks.py             # on the chip (90 compiles)
    python3 benchmarks/attention_blocks.py --lengths 2048 --head-dims 128 --blocks 256 512 1024
    python benchmarks/attention_blocks.py --interpret --lengths 256 --head-dims 64 --blocks 128 256 \\
        --repeats 1                                                                    # a CPU smoke test
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from trainkit.attn import kernels


def configurations(length: int, blocks: list[int], compute_blocks: list[int]) -> list[tuple[int, int, int]]:
    """``(block_q, block_kv, block_kv_compute)`` of ``blocks`` that divide ``length``; the compute block the kv
    block itself or one of ``compute_blocks`` that divides it."""
    fitting = [b for b in blocks if length % b == 0]
    found = []
    for q, kv in itertools.product(fitting, fitting):
        found += [(q, kv, c) for c in sorted({kv, *(c for c in compute_blocks if c < kv and kv % c == 0)})]
    return found


def step(length: int, heads: int, causal: bool, sizes: tuple[int, int, int], interpret: bool) -> Callable:
    """The jitted forward and backward pass of one row's attention through the splash kernel at ``sizes``."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    bq, bkv, compute = sizes
    block_sizes = splash.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=compute,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=compute,
        block_q_dq=bq,
        block_kv_dq=bkv,
    )
    shape = (length, length)
    mask = masks.MultiHeadMask([masks.CausalMask(shape) if causal else masks.FullMask(shape)] * heads)
    kernel = splash.make_splash_mha_single_device(mask, block_sizes=block_sizes, interpret=interpret)

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return kernel(q, k, v).astype(jnp.float32).sum()

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def timed(function: Callable, arguments: tuple[jax.Array, ...], repeats: int) -> tuple[float, float]:
    """``(compile seconds, median seconds of one call)`` over ``repeats`` calls after a warm one."""
    start = time.perf_counter()
    compiled = function.lower(*arguments).compile()
    compile_seconds = time.perf_counter() - start
    jax.block_until_ready(compiled(*arguments))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*arguments))
        times.append(time.perf_counter() - start)
    return compile_seconds, statistics.median(times)


def shape_name(length: int, depth: int, causal: bool) -> str:
    return f"{length:>6} d{depth} {'causal' if causal else 'full  '}"


def measure_shape(args: argparse.Namespace, length: int, depth: int, causal: bool) -> dict:
    """Every configuration's time at one shape, and the best against the rule's."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(args.heads, length, depth)), jnp.bfloat16) for _ in range(3))
    rule = (kernels.block_size(length),) * 3
    results: dict[tuple[int, int, int], float] = {}
    for sizes in configurations(length, args.blocks, args.compute_blocks):
        try:
            compile_seconds, seconds = timed(
                step(length, args.heads, causal, sizes, args.interpret), (q, k, v), args.repeats
            )
        except Exception as error:  # noqa: BLE001 - a configuration the chip cannot compile is a row, not the end
            first_line = str(error).splitlines()[0][:100] if str(error) else ""
            print(f"  {shape_name(length, depth, causal)} {sizes}: {type(error).__name__}: {first_line}")
            continue
        results[sizes] = seconds
        mark = " (the rule)" if sizes == rule else ""
        took = f"{seconds * 1e3:8.3f} ms (compiled in {compile_seconds:.1f} s)"
        print(f"  {shape_name(length, depth, causal)} {sizes}: {took}{mark}", flush=True)
    best = min(results, key=results.__getitem__) if results else None
    return {
        "length": length,
        "head_dim": depth,
        "heads": args.heads,
        "causal": causal,
        "best": best,
        "best_ms": None if best is None else results[best] * 1e3,
        "rule": rule,
        "rule_ms": results[rule] * 1e3 if rule in results else None,
        "rule_over_best": results[rule] / results[best] if best is not None and rule in results else None,
        "device": jax.devices()[0].device_kind,
        "configurations": len(results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--blocks", type=int, nargs="+", default=[512, 1024, 2048], help="block_q and block_kv")
    parser.add_argument("--compute-blocks", type=int, nargs="+", default=[512], help="block_kv_compute, besides kv's")
    parser.add_argument("--causal", choices=["yes", "no", "both"], default="yes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--interpret", action="store_true", help="Pallas's interpreter: a CPU smoke test")
    args = parser.parse_args()
    causal = {"yes": [True], "no": [False], "both": [True, False]}[args.causal]
    for length, depth, is_causal in itertools.product(args.lengths, args.head_dims, causal):
        print(json.dumps(measure_shape(args, length, depth, is_causal)), flush=True)


if __name__ == "__main__":
    main()
