"""Past one device's memory along the context and pipeline axes (#62): the rows
``benchmarks/capacity.py --axes`` adds, compiled here for targets that are not here, never run.

**The longest sequence.** A fixed model (the LM example's blocks, 4 layers of width 1,024, bf16
compute, fp32 master weights, AdamW) on ``tpu v5e:2x4``: the longest sequence whose train step
fits, without a context axis (``FSDP``, one sequence per device: the least a data-sharded
strategy holds) and with one (``Hybrid(data=1, context=8)``: one sequence over all 8 devices). The
search doubles the length from 1,024 until it does not fit, then halves the bracket down to 256
tokens. The bound of the context row: eight times FSDP's longest sequence, what a context axis
of 8 would hold were a sequence's activations linear in its length (attention's scores grow with
its square, so a split holds less); the FSDP probes' temporaries, fitted as ``a T + b T^2``, say
how much of them is quadratic. Under the context axis the state is replicated (the axis leaves
no device to shard it over). The context row twice: with the model's attention written out (the
compiler splits it by the layout) and by ``jax.nn.dot_product_attention`` (``ByteLM(
jax_attention=True)``: trainkit splits it by hand, its causal work balanced; :func:`split_row`).

**Two slices.** A stacked LM (24 layers of width 2,048, 1.2B parameters, sequence 1,024, 32
sequences a step, the blocks rematerialised) on
``tpu v5p:2x2x1 x2``: data parallelism across the slices (``Hybrid(data=2, fsdp=4)``) against a
pipeline across them (``Hybrid(stage=2, fsdp=4, microbatches=8)``): the bytes one device sends
to the other slice per step, as libtpu compiled them (its megascale sends), beside the
arithmetic: data parallelism reduces each device's gradient shard across the slices once, in the
compute dtype (``2 P / 4`` bytes: ``P`` parameters, bf16, over the 4 devices of a slice's FSDP); the
pipeline hands
each microbatch's activations on and their cotangents back at every tick (the bubble's ticks too:
``M + S - 1`` of them) and sends the last stage's outputs to the other stages, which run the
head too (it is replicated over the stages), and their cotangents back, all bf16 and a quarter
per device, plus the gradients of the embedding and head
(outside the stages, replicated over them). Loops count once per iteration
(:mod:`trainkit.planning.dcn`).

    python benchmarks/capacity.py --axes [--out F]
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import jax
import numpy as np
import optax
from lm import ByteLM

import trainkit as tk
from trainkit.planning import plan as plan_lib
from trainkit.planning import targets as targets_lib

SEQUENCE_TARGET = "tpu v5e:2x4"
SLICES_TARGET = "tpu v5p:2x2x1 x2"


Candidate = str | Callable[[list[jax.Device]], tk.Strategy]  # a name, or a strategy on the target's devices


def _plan(
    model: ByteLM, strategy: Candidate, rows: int, length: int, target: str, remat: list[str] | None = None
) -> plan_lib.PlanRow:
    trainer = tk.Trainer(
        model, loss="sparse_categorical_crossentropy", optimizer=optax.adamw(1e-4), precision="bf16", remat=remat
    )
    tokens = jax.ShapeDtypeStruct((rows, length), np.int32)
    plan = trainer.plan((tokens, tokens), target=target, candidates=[strategy], verbose=0, add_measures=False)
    return plan.rows[0]


def longest(fits: Callable[[int], bool], start: int = 1024, step: int = 256) -> int:
    """The longest length (a multiple of ``step``) ``fits`` accepts: doubling, then bisecting."""
    low, high = 0, start
    while fits(high):
        low, high = high, high * 2
    while high - low > step:
        middle = (low + high) // 2 // step * step
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def sequence_rows() -> list[dict]:
    target = targets_lib.parse(SEQUENCE_TARGET)
    devices, limit = target.device_count, float(target.memory_limit)
    probes: dict[str, dict[int, plan_lib.PlanRow]] = {"fsdp": {}, "context": {}}
    found = {kind: longest(_fits(kind, probes[kind])) for kind in probes}
    # the FSDP temporaries per sequence (one per device) as a T + b T^2, from its two longest probes that compiled:
    # how much of them grows with the square of the length (attention's scores)
    fitted = sorted((t, r.temp_bytes) for t, r in probes["fsdp"].items() if r.error is None)[-2:]
    (t1, m1), (t2, m2) = fitted
    b = (m2 / t2 - m1 / t1) / (t2 - t1)
    a = m1 / t1 - b * t1
    longest_fsdp = found["fsdp"]
    bound = devices * longest_fsdp  # a sequence's activations split 8 ways, were they linear in its length
    return [
        {"row": "longest sequence", "target": SEQUENCE_TARGET, "strategy": "FSDP (one sequence per device)",
         "length": longest_fsdp, "fsdp_fit": {"a": a, "b": b},
         "quadratic_share": b * longest_fsdp**2 / (a * longest_fsdp + b * longest_fsdp**2)},
        _context_row("context", found["context"], probes["context"], bound, limit),
        split_row(bound, start=found["context"]),
    ]  # fmt: skip


def split_row(bound: int, start: int) -> dict:
    """The context row with the model's attention by ``jax.nn.dot_product_attention``, which the
    context axis splits by hand, balanced (``ByteLM(jax_attention=True)``); the search starts at
    ``start`` (the written-out row's length)."""
    target = targets_lib.parse(SEQUENCE_TARGET)
    probes: dict[int, plan_lib.PlanRow] = {}
    length = longest(_fits("split", probes), start=start)
    return _context_row("split", length, probes, bound, float(target.memory_limit))


def _fits(kind: str, probes: dict[int, plan_lib.PlanRow]) -> Callable[[int], bool]:
    """``kind``'s probe of a length: ``fsdp`` (one sequence per device), ``context`` (one sequence
    over all the devices, the attention written out) or ``split`` (the same, by ``jax.nn``'s)."""
    devices = targets_lib.parse(SEQUENCE_TARGET).device_count

    def compiled(length: int) -> bool:
        model = ByteLM(layers=4, d_model=1024, heads=8, mlp=4096, max_len=length, jax_attention=kind == "split")
        if kind == "fsdp":
            row = _plan(model, "fsdp", devices, length, SEQUENCE_TARGET)
        else:
            context = lambda on: tk.Hybrid(data=1, context=devices, devices=on)  # noqa: E731
            row = _plan(model, context, 1, length, SEQUENCE_TARGET)
        probes[length] = row
        print(
            f"  {kind:8} T={length:>7}: {row.total_bytes / 2**30:6.2f} GiB {'fits' if row.fits else 'no'}", flush=True
        )
        return row.fits

    return compiled


def _context_row(kind: str, length: int, probes: dict[int, plan_lib.PlanRow], bound: int, limit: float) -> dict:
    row, devices = probes[length], targets_lib.parse(SEQUENCE_TARGET).device_count
    how = "attention by jax.nn, split by hand" if kind == "split" else "attention written out"
    return {"row": "longest sequence", "target": SEQUENCE_TARGET, "strategy": f"Hybrid(data=1, context={devices})",
            "attention": how, "length": length, "bound": bound, "ratio": length / bound,
            "state_per_device": row.argument_bytes, "temp_per_device": row.temp_bytes, "limit": limit,
            "notes": row.layout_notes()}  # fmt: skip


def slice_rows() -> list[dict]:
    layers, width, length, rows, stages, microbatches = 24, 2048, 1024, 32, 2, 8
    model = ByteLM(layers=layers, d_model=width, heads=width // 128, mlp=4 * width, max_len=length, stacked=True)
    parameters = sum(
        math.prod(leaf.shape)
        for leaf in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, length), np.int32)))
    )
    outside = 256 * width * 2 + length * width + width  # embedding, head, positions, final norm
    microbatch = rows // microbatches * length * width * 2 / 4  # one microbatch's bf16 activations, per device
    ticks = microbatches + stages - 1
    expected = {
        "data": 2 * parameters / 4,
        # forward and back: a hand-off each tick (the bubble's too), the last stage's outputs to the other
        # stages, which run the head too (it is replicated over them), and the gradients of what is outside
        "pipeline": 2 * microbatch * (ticks + microbatches * (stages - 1)) + 2 * outside / 4,
    }
    candidates: dict[str, Candidate] = {
        "data": lambda on: tk.Hybrid(data=2, fsdp=4, devices=on),
        "pipeline": lambda on: tk.Hybrid(stage=stages, fsdp=4, microbatches=microbatches, devices=on),
    }
    found = []
    for kind, strategy in candidates.items():
        start = time.perf_counter()
        row = _plan(model, strategy, rows, length, SLICES_TARGET, remat=["Block"])
        found.append(
            {"row": "across two slices", "target": SLICES_TARGET, "strategy": row.name, "parameters": parameters,
             "layers": layers, "width": width, "length": length, "rows": rows,
             "dcn_bytes": row.dcn_bytes, "expected_dcn_bytes": expected[kind],
             "ratio": expected[kind] / row.dcn_bytes if row.dcn_bytes else None, "bubble": row.bubble,
             "total_per_device": row.total_bytes, "fits": row.fits, "error": row.error,
             "collectives": row.collectives, "seconds": time.perf_counter() - start}
        )  # fmt: skip
        sent, arithmetic = row.dcn_bytes / 2**20, expected[kind] / 2**20
        print(f"  {row.name}: {sent:,.1f} MiB over DCN per device, expected {arithmetic:,.1f}", flush=True)
    return found
