"""A model with two outputs, trained Keras-style: which digit (10 classes) and whether it is even.

    python examples/digits_two_heads.py --devices 8            # DataParallel on 8 fake CPU devices

One loss per output (``loss={"digit": ..., "even": ...}``), weighted by ``loss_weights``, and
metrics per output: the logs hold ``loss``, ``digit_loss``, ``even_loss``, ``digit_accuracy``,
``even_accuracy`` and ``even_auc``, as Keras names them. Both heads output logits, so the
metrics by name read logits (``even_accuracy`` thresholds the logit at 0). The digits ship
inside scikit-learn; a fifth is held out, and the script exits non-zero when the held-out
digit accuracy falls below ``--min-accuracy``.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=0, help="fake this many CPU devices (0: the real ones)")
    parser.add_argument("--strategy", default="dp", choices=["single", "dp", "fsdp"], help="the devices' strategy")
    parser.add_argument("--epochs", type=int, default=20, help="epochs to train")
    parser.add_argument("--min-accuracy", type=float, default=0.9, help="exit non-zero below this accuracy")
    parser.add_argument("--verbose", type=int, default=0, help="0, 1 or 2, as Keras's fit")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.devices:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    import flax.linen as nn
    import numpy as np
    import optax
    from sklearn.datasets import load_digits

    import trainkit as tk

    class TwoHeads(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            hidden = nn.relu(nn.Dense(64)(x))
            return {"digit": nn.Dense(10, name="digit")(hidden), "even": nn.Dense(1, name="even")(hidden)}

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x))
    x, labels = x[order], digits.target[order].astype(np.int32)
    y = {"digit": labels, "even": (labels % 2 == 0).astype(np.float32)[:, None]}
    split = int(0.8 * len(x))
    train = (x[:split], {k: v[:split] for k, v in y.items()})
    held_out = (x[split:], {k: v[split:] for k, v in y.items()})

    trainer = tk.Trainer(
        TwoHeads(),
        loss={"digit": "sparse_categorical_crossentropy", "even": "binary_crossentropy"},
        loss_weights={"digit": 1.0, "even": 0.5},
        metrics={"digit": ["accuracy"], "even": ["accuracy", "auc"]},
        optimizer=optax.adam(3e-3),
        strategy={"single": "single", "dp": tk.DataParallel(), "fsdp": tk.FSDP()}[args.strategy],
    )
    history = trainer.fit(*train, epochs=args.epochs, batch_size=64, validation_data=held_out, verbose=args.verbose)
    logs = trainer.evaluate(*held_out, batch_size=64, return_dict=True)
    print(f"trainkit two-output model: logged {', '.join(sorted(history.history))}")
    print(
        f"held-out digit accuracy {logs['digit_accuracy']:.4f}, even accuracy {logs['even_accuracy']:.4f}, "
        f"even AUC {logs['even_auc']:.4f}"
    )
    predictions = trainer.predict(held_out[0])
    print(f"predict returns {sorted(predictions)} with shapes {[predictions[k].shape for k in sorted(predictions)]}")
    return 0 if logs["digit_accuracy"] >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
