"""A byte-level transformer language model trained on Python's own standard library sources.

The model is a decoder-only transformer written with Flax linen whose parameters carry logical
axis names (``nn.with_logical_partitioning``): ``vocab``, ``embed``, ``heads``, ``kv``, ``mlp``;
activations are constrained with ``nn.with_logical_constraint`` (``batch``, ``length``,
``embed``). The strategy's rules map those names onto its mesh, so one model trains under
``FSDP`` (``embed`` sharded over ``fsdp``) or tensor-parallel ``Hybrid(data=2, model=4)``
(Megatron-style: attention heads and the MLP's hidden units split over ``model``) without a
line of it changing. The corpus is the ``.py`` files of the running interpreter's standard
library, read as bytes (vocabulary 256); the last 10% is held out. The report: held-out loss in
bits per byte, tokens per second and, where the device's peak is known, MFU (the model's own
flops) and HFU (the compiler's count).

    python examples/lm.py                          # 8 fake CPU devices, FSDP (the default), 600 steps
    python examples/lm.py --strategy tp --steps 300
    python examples/lm.py --strategy pipeline --steps 300   # the blocks stacked (nn.scan), two stages x data 4
    python examples/lm.py --strategy context --length 512   # each sequence split over 4 devices x data 2
    python examples/lm.py --strategy single --precision bf16 --remat full --grad-accum-steps 2
    python examples/lm.py --plan-target "tpu v5e:4x4" --layers 8 --d-model 1024 --length 1024 --batch-size 256
    python examples/lm.py --pack                    # each source file a document, packed into rows (segment ids)

``--pack`` trains on whole documents (each ``.py`` file one) packed into rows by ``tk.data.pack``:
attention stays within a document (``segment_ids``), positions restart at each document's start,
and the loss counts only positions whose target is in their own document (``loss_mask`` as a
per-token ``sample_weight``; the held-out figure is the mean over those positions).

``--plan-target`` trains nothing: it compiles this LM's real train step for a TPU slice or H100s
that are not here under FSDP and tensor-parallel Hybrid, prints the plan and exits
(docs/targets.md; needs the ``tpu-plan`` or ``gpu-plan`` extra).
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import sysconfig
import time

if __name__ == "__main__":  # fake CPU devices (8 unless --devices says; 0: the real ones), set before JAX starts
    count = sys.argv[sys.argv.index("--devices") + 1] if "--devices" in sys.argv else "8"
    if count != "0":
        os.environ.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=count)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import trainkit as tk  # noqa: E402
from trainkit.monitoring import throughput  # noqa: E402

#: Logical axis name -> mesh axis, per strategy (names a rule leaves out are an error).
#: Under FSDP the batch and the ``embed`` dimension of every weight share the ``fsdp`` axis (the
#: batch rule comes first: an activation's ``embed`` then stays whole); under tensor parallelism
#: heads, MLP units and the vocabulary split over ``model``, the batch over ``data``.
RULES = {
    "fsdp": [
        ("batch", "fsdp"),
        ("embed", "fsdp"),
        *[(name, None) for name in ("length", "vocab", "heads", "kv", "mlp", "layers")],
    ],
    "tp": [
        ("batch", "data"),
        ("heads", "model"),
        ("mlp", "model"),
        ("vocab", "model"),
        *[(name, None) for name in ("length", "embed", "kv", "layers")],
    ],
}


def logical(init, *names):
    return nn.with_logical_partitioning(init, names)


class Attention(nn.Module):
    """Causal multi-head self-attention; query/key/value kernels ``(embed, heads, kv)`` and the
    output kernel ``(heads, kv, embed)``: split over ``heads``, they are Megatron's column and
    row parallel layers. ``by_jax``: the scores by ``tk.attention`` (JAX's attention; on a TPU the
    Pallas kernel, which never writes them out whole; a context axis splits that call by hand, its
    causal work balanced over the devices) instead of written out (the compiler splits those by the
    layout alone)."""

    heads: int
    head_dim: int
    by_jax: bool = False

    @nn.compact
    def __call__(self, x, segment_ids=None):
        init = nn.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=0, out_axis=(1, 2))
        shape = (x.shape[-1], self.heads, self.head_dim)
        q, k, v = (
            jnp.einsum("bld,dhk->blhk", x, self.param(name, logical(init, "embed", "heads", "kv"), shape))
            for name in ("query", "key", "value")
        )
        if self.by_jax:
            out = tk.attention(q, k, v, causal=True, segment_ids=segment_ids)
        else:
            out = self._written_out(q, k, v, segment_ids)
        out_init = nn.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=(0, 1), out_axis=2)
        kernel = self.param("out", logical(out_init, "heads", "kv", "embed"), (self.heads, self.head_dim, x.shape[-1]))
        return jnp.einsum("blhk,hkd->bld", out, kernel)

    def _written_out(self, q, k, v, segment_ids=None):
        length = q.shape[1]
        mask = jnp.tril(jnp.ones((length, length), bool))
        if segment_ids is not None:  # packed documents: a query sees the keys of its own document only
            mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(self.head_dim)
        weights = jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(scores.dtype).min), axis=-1)
        return jnp.einsum("bhqs,bshk->bqhk", weights.astype(v.dtype), v)


class Block(nn.Module):
    heads: int
    head_dim: int
    mlp: int
    jax_attention: bool = False

    @nn.compact
    def __call__(self, x, segment_ids=None):
        norm = lambda: nn.LayerNorm(scale_init=logical(nn.initializers.ones, "embed"), use_bias=False)  # noqa: E731
        x = x + Attention(self.heads, self.head_dim, self.jax_attention)(norm()(x), segment_ids)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        h = nn.Dense(self.mlp, kernel_init=logical(nn.initializers.lecun_normal(), "embed", "mlp"), use_bias=False)(
            norm()(x)
        )
        h = nn.gelu(h)
        x = x + nn.Dense(
            x.shape[-1], kernel_init=logical(nn.initializers.lecun_normal(), "mlp", "embed"), use_bias=False
        )(h)
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class StackedBlock(nn.Module):
    """A :class:`Block` as ``nn.scan`` takes it (``(carry, per-layer input) -> (carry, output)``)."""

    heads: int
    head_dim: int
    mlp: int
    jax_attention: bool = False

    @nn.compact
    def __call__(self, x, _):
        return Block(self.heads, self.head_dim, self.mlp, self.jax_attention, name="block")(x), None


class ByteLM(nn.Module):
    """Bytes ``(batch, length)`` -> next-byte logits ``(batch, length, 256)``, or packed documents: a dict of
    ``tokens``, ``segment_ids`` and ``positions`` (:func:`trainkit.data.pack`'s), each position embedded by
    its place in its own document and attending within it; ``stacked=True``:
    the blocks are one ``nn.scan`` module (each parameter leads with the layer axis, named
    ``layers``), which a pipeline (``tk.Hybrid(stage=...)``) splits into stages;
    ``jax_attention=True``: each block's attention by ``tk.attention`` (the Pallas kernel on a TPU), which a
    context axis (``tk.Hybrid(context=...)``) splits by hand, balanced (docs/strategies.md)."""

    layers: int = 4
    d_model: int = 128
    heads: int = 4
    mlp: int = 512
    max_len: int = 256
    vocab: int = 256
    stacked: bool = False
    jax_attention: bool = False

    @nn.compact
    def __call__(self, tokens):
        segment_ids, place = None, None
        if isinstance(tokens, dict):  # packed documents
            tokens, segment_ids, place = tokens["tokens"], tokens["segment_ids"], tokens["positions"]
            if self.stacked:
                raise ValueError("packed documents take the unstacked blocks: use another strategy than pipeline")
        embed = nn.Embed(
            self.vocab, self.d_model, embedding_init=logical(nn.initializers.normal(0.02), "vocab", "embed")
        )
        positions = self.param(
            "positions", logical(nn.initializers.normal(0.02), "length", "embed"), (self.max_len, self.d_model)
        )
        x = embed(tokens) + (positions[None, : tokens.shape[1]] if place is None else positions[place])
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        if self.stacked:
            stack = nn.scan(
                StackedBlock,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=self.layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x, _ = stack(self.heads, self.d_model // self.heads, self.mlp, self.jax_attention, name="blocks")(x, None)
        for _ in range(0 if self.stacked else self.layers):
            x = Block(self.heads, self.d_model // self.heads, self.mlp, self.jax_attention)(x, segment_ids)
        x = nn.LayerNorm(scale_init=logical(nn.initializers.ones, "embed"), use_bias=False)(x)
        return nn.Dense(
            self.vocab, kernel_init=logical(nn.initializers.lecun_normal(), "embed", "vocab"), use_bias=False
        )(x)


def stdlib_bytes(limit: int) -> np.ndarray:
    """Up to ``limit`` bytes of the standard library's ``.py`` files, in a fixed order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return np.frombuffer(b"".join(chunks)[:limit], dtype=np.uint8)


def stdlib_documents(limit: int) -> list[np.ndarray]:
    """The standard library's ``.py`` files as byte documents, in a fixed order, ``limit`` bytes in all
    (the last one cut there)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    documents, total = [], 0
    for path in sorted(root.glob("*.py")):
        documents.append(np.frombuffer(path.read_bytes()[: limit - total], dtype=np.uint8).astype(np.int32))
        total += len(documents[-1])
        if total >= limit:
            break
    return documents


def packed_rows(documents: list[np.ndarray], length: int) -> tuple[dict, np.ndarray, np.ndarray]:
    """``documents`` packed into rows of ``length`` (:func:`trainkit.data.pack`): the model's inputs, the
    targets, and the loss's mask as a per-token ``sample_weight`` (padding and no target across a boundary)."""
    packed = tk.data.pack(documents, length=length)
    x = {name: packed[name] for name in ("tokens", "segment_ids", "positions")}
    return x, packed["targets"], packed["loss_mask"]


def first_rows(tree, count: int):
    return jax.tree.map(lambda a: a[:count], tree)


def windows(corpus: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping windows of ``length + 1`` bytes: inputs and next-byte targets."""
    count = (len(corpus) - 1) // length
    data = np.lib.stride_tricks.sliding_window_view(corpus, length + 1)[: count * length : length]
    return data[:, :-1].astype(np.int32), data[:, 1:].astype(np.int32)


def strategy_for(name: str):
    if name == "fsdp":
        return tk.FSDP(rules=RULES["fsdp"])
    if name == "tp":
        return tk.Hybrid(data=2, model=len(jax.devices()) // 2, rules=RULES["tp"])
    if name == "pipeline":  # the stacked blocks in two stages, the rest of the devices on data
        return tk.Hybrid(stage=2, microbatches=4)
    if name == "context":  # each sequence over half the devices, its attention split by hand and balanced
        return tk.Hybrid(data=2, context=len(jax.devices()) // 2)
    return name  # "auto", "single", "dp"


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--strategy",
        default="fsdp",
        help="fsdp, tp (data x model), pipeline (stage x data), context (data x context), dp, single or auto",
    )
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch, in sequences")
    parser.add_argument("--length", type=int, default=128, help="bytes (tokens) per sequence")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--d-model", type=int, default=128, help="model width")
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000, help="bytes of standard-library sources read")
    parser.add_argument("--precision", default="fp32", help="fp32, bf16 or fp16 (mixed)")
    parser.add_argument("--remat", default=None, help="full, dots, dots_no_batch, or module class names")
    parser.add_argument("--grad-accum-steps", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument(
        "--offload", default=None, choices=["optimizer", "auto"], help="the optimizer's state in host memory"
    )
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices (0: the real ones, a GPU or TPU)")
    parser.add_argument("--verbose", type=int, default=1, help="0, 1 or 2, as Keras's fit")
    parser.add_argument(
        "--plan-target", default=None, help='plan for absent devices ("tpu v5e:4x4", "h100 x8") and exit'
    )
    parser.add_argument("--pack", action="store_true", help="whole source files as documents, packed into rows")
    args = parser.parse_args(argv)
    if args.pack and args.strategy == "pipeline":
        parser.error("--pack takes the unstacked blocks: pick another --strategy than pipeline")

    if args.pack:  # whole files, every tenth held out
        documents = stdlib_documents(args.corpus_bytes)
        held_out = [d for i, d in enumerate(documents) if i % 10 == 9]
        documents = [d for i, d in enumerate(documents) if i % 10 != 9]
        (x, y, w), (x_val, y_val, w_val) = packed_rows(documents, args.length), packed_rows(held_out, args.length)
    else:
        corpus = stdlib_bytes(args.corpus_bytes)
        split = int(len(corpus) * 0.9)
        x, y = windows(corpus[:split], args.length)
        x_val, y_val = windows(corpus[split:], args.length)
        w = w_val = None  # every position trains
    rows = len(jax.tree.leaves(x)[0])
    # a pipeline splits the blocks stacked into one nn.scan module; a context axis splits tk.attention by hand, and
    # on a TPU tk.attention is the Pallas kernel (long sequences on one chip)
    model = ByteLM(
        layers=args.layers,
        d_model=args.d_model,
        max_len=args.length,
        stacked=args.strategy == "pipeline",
        jax_attention=args.strategy == "context" or jax.default_backend() == "tpu",
    )
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, min(100, args.steps // 10 + 1), args.steps)
    trainer = tk.Trainer(
        model,
        loss="sparse_categorical_crossentropy",
        optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01)),
        strategy=strategy_for(args.strategy),
        precision=args.precision,
        remat=args.remat,
        grad_accum_steps=args.grad_accum_steps,
        offload=args.offload,
    )
    what = f"rows of {len(documents)} packed files" if args.pack else "windows"
    print(
        f"trainkit {tk.__version__}: byte LM, {rows} training {what} of {args.length} bytes "
        f"({len(jax.tree.leaves(x_val)[0])} held out) on {len(jax.devices())} {jax.devices()[0].platform} devices"
    )
    if args.plan_target:  # compiled for the target's devices, nothing placed here: FSDP and data x model
        candidates = [
            lambda devices: tk.FSDP(devices, rules=RULES["fsdp"]),
            # the model axis no wider than the 4 heads it splits
            lambda devices: tk.Hybrid(model=min(4, len(devices) // 2), rules=RULES["tp"], devices=devices),
        ]
        plan = trainer.plan(
            (first_rows(x, 8), first_rows(y, 8)),
            batch_size=args.batch_size,
            target=args.plan_target,
            candidates=candidates,
        )
        return plan
    trainer.init(
        (first_rows(x, args.batch_size), first_rows(y, args.batch_size))
    )  # "auto" (or offload="auto") plans this batch
    print(f"{trainer.count_params():,} parameters; strategy {trainer.strategy.describe()}")
    timer = Timer()
    trainer.fit(
        x,
        y,
        sample_weight=w,
        batch_size=args.batch_size,
        epochs=math.ceil(args.steps * args.batch_size / rows),
        max_steps=args.steps,
        verbose=args.verbose,
        callbacks=[timer],
    )
    val_loss = trainer.evaluate(x_val, y_val, sample_weight=w_val, batch_size=args.batch_size)
    if args.pack:  # the mean over rows of (sum over trained positions) / length, as the mean per trained position
        val_loss *= w_val.size / w_val.sum()
    tokens_per_second = timer.steps * args.batch_size * args.length / timer.seconds
    peak = throughput.peak_flops(jax.devices()[0].device_kind, args.precision)
    per_second = timer.steps / timer.seconds / (peak * len(jax.devices())) if peak else 0.0
    model, hardware = tk.debug.model_step_flops(trainer), tk.debug.step_flops(trainer)  # MFU's and HFU's counts
    mfu = (
        f", MFU {model * per_second:.1%} (HFU {hardware * per_second:.1%})" if per_second and model and hardware else ""
    )
    print(
        f"held-out loss {val_loss / math.log(2):.3f} bits per byte after {trainer.global_step} steps; "
        f"{tokens_per_second:,.0f} tokens/s (steps after the first){mfu}"
    )
    return val_loss / math.log(2)


class Timer(tk.callbacks.Callback):
    """Seconds and steps after the first step (which compiles)."""

    async_safe = True

    def on_train_batch_end(self, batch, logs=None):
        step = self.session.record.step  # the step this (possibly late) hook is about
        if not hasattr(self, "start"):
            self.start, self.first = time.perf_counter(), step
        self.steps, self.seconds = step - self.first, time.perf_counter() - self.start


if __name__ == "__main__":
    main()
