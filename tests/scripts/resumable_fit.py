"""A training run with BackupAndRestore, for the fault tests: it is killed and run again.

    python resumable_fit.py BACKUP_DIR OUT.npz [--sleep S] [--width W] [--lora] [--no-backup]

Writes the final parameters to OUT.npz. ``--sleep`` slows each step (without changing the
numbers) so a test can interrupt it; ``--width`` makes the model, and so each save, larger.
``--data grain`` feeds a grain iterator (a shuffled, repeated stream; 13 steps per epoch)
whose position is saved with each backup, and prints how many rows this run read.
``--journal-seconds`` sets how often the goodput journal is rewritten (0: every step); the
run prints its goodput ledger's lost steps, restarts and lost seconds at the end.
``--no-backup`` trains without BackupAndRestore: the tests' uninterrupted reference, which also
checks that the saves change no number. ``--lora`` trains LoRA adapters on base weights loaded
with ``tk.weights.load`` (the backups hold the adapters only).
"""

import argparse
import logging
import os
import sys
import time

# the test's compiler settings (tests/conftest.py's subprocess_cache_env) kept, with 8 devices
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import trainkit as tk  # noqa: E402

logging.basicConfig(format="%(name)s: %(message)s")
logging.getLogger("trainkit").setLevel(logging.INFO)  # the resume message is INFO


class Rows:
    """Row ``i`` of the data (grain's map step), counting the rows this process read."""

    read = 0

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __call__(self, i):
        Rows.read += 1
        return self.x[i], self.y[i]


def grain_stream(x, y):
    import grain

    pipeline = grain.MapDataset.source(list(range(len(x)))).shuffle(seed=3).repeat(None).map(Rows(x, y))
    return iter(pipeline.to_iter_dataset(grain.ReadOptions(prefetch_buffer_size=0)).batch(16))  # reads counted exactly


class Net(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(self.width)(x))
        x = nn.Dropout(0.1, deterministic=not train)(x)
        return nn.Dense(3)(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("backup")
    parser.add_argument("out")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--journal-seconds", type=float, default=10.0)
    parser.add_argument("--strategy", choices=["dp", "fsdp"], default="dp")
    parser.add_argument("--data", choices=["arrays", "grain"], default="arrays")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--offload", default=None, help="Trainer(offload=...): the optimizer's state in host memory")
    parser.add_argument("--no-backup", dest="backup_saves", action="store_false")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 5)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5)).astype(np.int32)
    trainer = tk.Trainer(
        Net(args.width),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.adam(1e-2),
        strategy=tk.DataParallel() if args.strategy == "dp" else tk.FSDP(min_shard_size=16),
        seed=1,
        lora=tk.LoRA(rank=4, alpha=8) if args.lora else None,
        offload=args.offload,
    )
    if args.lora:  # base weights from a seed, loaded before fit: the backup records their hash
        trainer.init(x[:16])
        base = np.random.default_rng(7)
        weights = {"Dense_0/kernel": base.normal(size=(5, args.width)), "Dense_0/bias": np.zeros(args.width)}
        weights |= {"Dense_1/kernel": base.normal(size=(args.width, 3)), "Dense_1/bias": np.zeros(3)}
        tk.weights.load({k: v.astype(np.float32) for k, v in weights.items()}, into=trainer)
    slow = tk.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs=None: time.sleep(args.sleep))
    grain = args.data == "grain"
    backup = tk.callbacks.BackupAndRestore(args.backup, save_freq=args.every)
    backup.journal_seconds = args.journal_seconds
    history = trainer.fit(
        grain_stream(x, y) if grain else (x, y),
        epochs=4,
        steps_per_epoch=13 if grain else None,
        batch_size=None if grain else 16,
        verbose=0,
        callbacks=[backup, slow] if args.backup_saves else [slow],
    )
    flat = {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(trainer.params)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    np.savez(args.out, step=int(trainer.state.step), **flat)
    print(f"finished at step {int(trainer.state.step)}; read {Rows.read} rows", flush=True)
    goodput = history.goodput
    lost = goodput.buckets.get("lost", 0.0)
    print(f"goodput: lost_steps={goodput.lost_steps} restarts={goodput.restarts} lost={lost}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
