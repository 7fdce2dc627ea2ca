"""Train a small CNN on scikit-learn's bundled handwritten digits on any strategy.

    python examples/digits_cnn.py --devices 8                    # 8 fake CPU devices, "auto"
    python examples/digits_cnn.py --devices 8 --strategy fsdp    # or single, dp, fsdp, hybrid

With ``--strategy auto`` (the default) the Trainer compiles and times the train step under the
simplest strategy, and under the others only when this run is long enough to repay their
compiles, prints why it picked one, and ``--plan`` prints the whole table (every strategy). Keras's callbacks
run as in Keras: ``EarlyStopping`` restores the best epoch's weights, ``ReduceLROnPlateau``
halves the learning rate on a plateau, ``ModelCheckpoint`` keeps the best epoch in
``--out``/best (an orbax checkpoint ``trainer.load`` reads) and ``CSVLogger`` writes
``--out``/log.csv; with the ``monitoring`` extra, ``TensorBoard`` writes ``--out``/tensorboard
(``GradientStats`` its per-layer norms to ``--out``/tensorboard/gradient_stats) and
``history.plot`` draws ``--out``/curves.png. ``fit`` ends with where the time went.

The 1,797 8x8 digit images ship inside scikit-learn (no download). A fifth is the test split,
which no callback sees; a fifth of the rest is the validation split that ``EarlyStopping`` and
``ModelCheckpoint`` watch (the epoch they keep is picked on it). The script prints the
strategy that ran and why, the test accuracy of the restored best epoch, and exits non-zero
below ``--min-accuracy``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--devices", type=int, default=0, help="fake this many CPU devices (0: use the real local devices)"
    )
    parser.add_argument(
        "--strategy",
        default="auto",
        choices=["auto", "single", "dp", "fsdp", "hybrid"],
        help="hybrid: data=2 x fsdp=devices/2",
    )
    parser.add_argument("--plan", action="store_true", help="print the compiled plan of every strategy")
    parser.add_argument("--epochs", type=int, default=15, help="at most (EarlyStopping may stop sooner)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--learning-rate", type=float, default=2e-3, help="Adam's")
    parser.add_argument("--seed", type=int, default=0, help="initialisation, dropout, shuffling and the splits")
    parser.add_argument("--precision", default="fp32", help="fp32, bf16 or fp16 (mixed)")
    parser.add_argument("--grad-accum-steps", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--min-accuracy", type=float, default=0.95, help="exit non-zero below this test accuracy")
    parser.add_argument("--verbose", type=int, default=1, help="0, 1 or 2, as Keras's fit")
    parser.add_argument(
        "--data-on-device", choices=["auto", "on", "off"], default="auto",
        help="keep the arrays on the devices, a fused call gathering its rows there (docs/data.md)",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="checkpoint and CSV log directory (default: a new temp dir)")
    parser.add_argument(
        "--backup", default=None, help="BackupAndRestore's folder: run again to resume (under Ray: Ray's checkpoints)"
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # --plan compiles the step under every strategy; for the Hybrid meshes XLA's partitioner
    # warns that it reshards avg_pool's gradient the slow way ("Involuntary full
    # rematerialization"). The measured plan already ranks them last; keep the output readable.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.devices:  # must happen before JAX is imported
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
        )

    import flax.linen as nn
    import jax
    import numpy as np
    import optax
    from sklearn.datasets import load_digits

    import trainkit as tk

    class CNN(nn.Module):
        """Two 3x3 convolutions with ReLU and average pooling, then a 256-unit dense layer."""

        @nn.compact
        def __call__(self, x):
            x = nn.Conv(32, (3, 3))(x)
            x = nn.avg_pool(nn.relu(x), (2, 2), strides=(2, 2))
            x = nn.Conv(64, (3, 3))(x)
            x = nn.avg_pool(nn.relu(x), (2, 2), strides=(2, 2))
            x = nn.relu(nn.Dense(256)(x.reshape(x.shape[0], -1)))
            return nn.Dense(10)(x)

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]  # (1797, 8, 8, 1) in [0, 1]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(args.seed).permutation(len(labels))
    fifth = len(labels) // 5
    test, validation, train = order[:fifth], order[fifth : 2 * fifth], order[2 * fifth :]

    trainer = tk.Trainer(
        CNN(),
        loss=optax.softmax_cross_entropy_with_integer_labels,
        # a schedule through inject_hyperparams shows the learning rate in the logs
        optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=args.learning_rate),
        metrics=["accuracy"],
        strategy=tk.Hybrid(data=2, fsdp=jax.device_count() // 2) if args.strategy == "hybrid" else args.strategy,
        seed=args.seed,
        precision=args.precision,
        grad_accum_steps=args.grad_accum_steps,
    )
    print(f"trainkit {tk.__version__} on {jax.device_count()} {jax.devices()[0].platform} devices")
    if args.plan:
        trainer.plan((images[train][: args.batch_size], labels[train][: args.batch_size]), measure=True)
    out = args.out or tempfile.mkdtemp(prefix="digits-cnn-")
    callbacks = [
        tk.callbacks.EarlyStopping(monitor="val_accuracy", patience=5, restore_best_weights=True),
        tk.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=2),
        tk.callbacks.ModelCheckpoint(os.path.join(out, "best"), monitor="val_accuracy", save_best_only=True),
        tk.callbacks.CSVLogger(os.path.join(out, "log.csv")),
    ]
    if args.backup:  # an interrupted run, started again, resumes where the last backup left off
        callbacks.append(tk.callbacks.BackupAndRestore(args.backup))
    if importlib.util.find_spec("tensorboardX"):  # the monitoring extra: tensorboard --logdir OUT/tensorboard
        # norms of every layer's gradients, weights and updates, measured inside the step every 20 steps
        board = os.path.join(out, "tensorboard", "gradient_stats")
        callbacks.append(tk.callbacks.GradientStats(every=20, per_layer=".*", log_dir=board))
        callbacks.append(tk.callbacks.TensorBoard(os.path.join(out, "tensorboard"), histogram_freq=5))
    start = time.perf_counter()
    history = trainer.fit(
        (images[train], labels[train]),
        epochs=args.epochs,
        batch_size=args.batch_size,
        validation_data=(images[validation], labels[validation]),
        verbose=args.verbose,
        callbacks=callbacks,
        data_on_device={"auto": "auto", "on": True, "off": False}[args.data_on_device],
    )
    seconds = time.perf_counter() - start
    if trainer.last_plan is not None:
        print(f"strategy='auto' {trainer.last_plan.reason()}")
    elif args.strategy == "auto":  # no plan this time: an earlier run's pick, remembered next to the compile cache
        print(f"strategy='auto' reused an earlier run's pick for this setup: {trainer.strategy.describe()}")
    else:
        print(f"strategy {trainer.strategy.describe()}: chosen with --strategy {args.strategy}")
    result = trainer.evaluate((images[test], labels[test]), batch_size=128, return_dict=True)
    predictions = trainer.predict(images[test], batch_size=128)
    assert predictions.shape == (len(test), 10)
    print(
        f"test accuracy {result['accuracy']:.4f}, loss {result['loss']:.4f} "
        f"({len(test)} images no callback saw; {len(history.epoch)} epochs in {seconds:.1f} s on "
        f"{trainer.strategy.describe()})"
    )
    stopper = callbacks[0]
    print(f"best epoch {stopper.best_epoch + 1} (val_accuracy {stopper.best:.4f}) restored and saved in {out}/best")
    print(f"per-epoch log: {out}/log.csv")
    if importlib.util.find_spec("matplotlib"):
        history.plot(os.path.join(out, "curves.png"), title=f"digits CNN, {trainer.strategy.describe()}")
        print(f"training curves: {out}/curves.png")
    if result["accuracy"] < args.min_accuracy:
        print(f"below the expected {args.min_accuracy:.2f}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
