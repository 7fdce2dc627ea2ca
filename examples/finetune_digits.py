"""Fine-tune published weights three ways: a CNN trained on digits 0-4 is published as
safetensors, then fine-tuned on digits 5-9 with all its weights, with a frozen body and a new
head, and with LoRA adapters (or QLoRA: ``--quantize-base nf4``).

    python examples/finetune_digits.py                        # 8 fake CPU devices, FSDP
    python examples/finetune_digits.py --strategy single --quantize-base nf4

Every way starts from the same file (``tk.weights.load``, which reports what it matched and
places each device's shard straight into the strategy's sharding) and trains the same number
of epochs on the same batches. The script prints, for each: test accuracy on digits 5-9,
trainable parameters, optimizer-state bytes, wall time, and for LoRA the size of its
checkpoint (the adapters and their optimizer state only) against a full one. The 1,797 8x8
digit images ship inside scikit-learn (no download); a fifth of each half is its test split.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument("--devices", type=int, default=8, help="fake this many CPU devices (0: the real devices)")
    parser.add_argument("--strategy", default="fsdp", choices=["single", "dp", "fsdp"], help="for every run")
    parser.add_argument("--pretrain-epochs", type=int, default=10, help="on digits 0-4")
    parser.add_argument("--epochs", type=int, default=6, help="fine-tuning epochs on digits 5-9, each way")
    parser.add_argument("--rank", type=int, default=2, help="LoRA rank (alpha = 2 x rank)")
    parser.add_argument("--quantize-base", default=None, choices=["nf4", "int8"], help="QLoRA: store Dense kernels so")
    parser.add_argument("--out", default=None, help="where the weights and checkpoints go (default: a new temp dir)")
    parser.add_argument("--min-accuracy", type=float, default=0.85, help="exit non-zero if a way ends below this")
    return parser.parse_args(argv)


def cnn():
    """Two 3x3 convolutions with average pooling, a 2,048-unit layer (wide, so that the adapters'
    share shows) and a 5-class head; the modules named, as published weights name them."""
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.avg_pool(nn.relu(nn.Conv(32, (3, 3), name="conv1")(x)), (2, 2), strides=(2, 2))
            x = nn.avg_pool(nn.relu(nn.Conv(64, (3, 3), name="conv2")(x)), (2, 2), strides=(2, 2))
            x = nn.relu(nn.Dense(2048, name="hidden")(x.reshape(x.shape[0], -1)))
            return nn.Dense(5, name="head")(x)

    return CNN()


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's resharding notes for FSDP's convolutions
    if args.devices:  # fake CPU devices: before JAX is imported
        os.environ.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(args.devices))
    import jax
    import numpy as np
    import optax
    from sklearn.datasets import load_digits

    import trainkit as tk

    digits = load_digits()
    images, labels = (digits.images / 16.0).astype(np.float32)[..., None], digits.target.astype(np.int32)

    def split(classes):
        rows = np.flatnonzero(np.isin(labels, classes))
        rows = rows[np.random.default_rng(0).permutation(len(rows))]
        fifth = len(rows) // 5
        x, y = images[rows], labels[rows] - classes[0]
        return (x[fifth:], y[fifth:]), (x[:fifth], y[:fifth])

    (old_train, old_test), (new_train, new_test) = split([0, 1, 2, 3, 4]), split([5, 6, 7, 8, 9])
    strategy = {"single": "single", "dp": tk.DataParallel, "fsdp": lambda: tk.FSDP(min_shard_size=256)}[args.strategy]

    def trainer(learning_rate=2e-3, **options):
        return tk.Trainer(
            cnn(),
            loss="sparse_categorical_crossentropy",
            optimizer=optax.adam(learning_rate),
            metrics=["accuracy"],
            strategy=strategy() if callable(strategy) else strategy,
            **options,
        )

    out = args.out or tempfile.mkdtemp(prefix="finetune-digits-")
    print(f"trainkit {tk.__version__} on {jax.device_count()} {jax.devices()[0].platform} devices, {args.strategy}")
    base = trainer()
    base.fit(old_train, batch_size=64, epochs=args.pretrain_epochs, verbose=0)
    published = os.path.join(out, "digits0-4.safetensors")
    base.save_weights(published)
    old_accuracy = base.evaluate(old_test, return_dict=True)["accuracy"]
    print(f"pre-trained on digits 0-4: test accuracy {old_accuracy:.4f}; published as {published}")

    lora = tk.LoRA(rank=args.rank, alpha=2.0 * args.rank, quantize_base=args.quantize_base)
    ways = {  # the fewer parameters train, the larger the rate they take
        "all weights": ({"learning_rate": 2e-3}, {}),
        "frozen body, new head": ({"trainable": r"^head/", "learning_rate": 1e-2}, {"keep_initial": [r"^head/"]}),
        ("QLoRA " + args.quantize_base if args.quantize_base else "LoRA") + f" rank {args.rank}": (
            {"lora": lora, "learning_rate": 1e-2},
            {},
        ),
    }
    header = f"{'fine-tuned on digits 5-9':24} {'accuracy':>8} {'trainable':>10} {'optimizer state':>16} {'seconds':>8}"
    rows, failed, trained_ways = [header, "-" * len(header)], False, {}
    for name, (options, load_options) in ways.items():
        tuned = trainer(**options)
        tuned.init(new_train[0][:64])
        report = tk.weights.load(published, into=tuned, **load_options)
        start = time.perf_counter()
        tuned.fit(new_train, batch_size=64, epochs=args.epochs, verbose=0)
        seconds = time.perf_counter() - start
        accuracy = tuned.evaluate(new_test, return_dict=True)["accuracy"]
        trained, _ = tuned.program.trainable.partition(tuned.state.params)
        optimizer_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(tuned.state.opt_state))
        rows.append(
            f"{name:24} {accuracy:8.4f} {sum(np.size(a) for a in trained):>10,} "
            f"{optimizer_bytes / 1024:>13,.1f} KiB {seconds:8.2f}"
        )
        print(f"{name}: {report}")
        failed |= accuracy < args.min_accuracy
        trained_ways[name] = tuned
    print("\n".join(rows))

    full, adapters = os.path.join(out, "full-checkpoint"), os.path.join(out, "lora-checkpoint")
    lora_trainer = list(trained_ways.values())[-1]
    trained_ways["all weights"].save(full)
    lora_trainer.save(adapters)
    sizes = {path: sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
             for path in (full, adapters)}  # fmt: skip
    print(
        f"LoRA checkpoint {sizes[adapters] / 1024:,.1f} KiB against {sizes[full] / 1024:,.1f} KiB for the full state "
        f"({sizes[adapters] / sizes[full]:.1%}): the adapters and their optimizer state, and the base's SHA-256"
    )
    merged = lora_trainer.merge_lora()
    gap = float(np.abs(merged.predict(new_test[0]) - lora_trainer.predict(new_test[0])).max())
    print(f"merge_lora(): a plain CNN whose predictions differ from the adapters' by at most {gap:.1e}")
    if failed:
        print(f"a way ended below {args.min_accuracy:.2f}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
