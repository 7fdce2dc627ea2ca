"""Train from files on disk through grain, with worker processes, and resume after an interruption.

    python examples/from_files.py                 # shards in a temp dir, 2 grain workers
    python examples/from_files.py --workers 0 --data-dir /tmp/digits-shards

1. The 1,797 8x8 digit images that ship inside scikit-learn are written as ``.npy`` shards
   (8 shards of images and labels), the layout of a dataset too large for memory.
2. A grain pipeline reads them: a random-access source over the memory-mapped shards, shuffled
   by seed anew every epoch, decoded (uint8 -> float) by ``--workers`` processes
   (``mp_prefetch``), batched. ``fit`` takes the grain iterator as it is; with several processes
   each would read ``dataset[jax.process_index()::jax.process_count()]``.
3. The run is interrupted at step ``--interrupt-at`` (as SIGTERM on a preemptible machine does:
   the step finishes, ``BackupAndRestore`` writes a backup holding the grain iterator's position,
   and ``fit`` raises ``tk.Preempted``). A second ``fit``, from a fresh process state, resumes:
   the iterator continues where it stood, without reading the batches before it again.
4. The script checks that the resumed run ends with the parameters of an uninterrupted one
   (``--check-exact``, the default) and prints the held-out accuracy; it exits non-zero when
   either fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--data-dir", default=None, help="where the shards are written (default: a temp dir)")
    parser.add_argument("--workers", type=int, default=2, help="grain worker processes (0: read in trainkit's thread)")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps in all")
    parser.add_argument("--interrupt-at", type=int, default=120, help="the step the first run is preempted at")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--no-check-exact", dest="check_exact", action="store_false")
    parser.add_argument("--min-accuracy", type=float, default=0.9, help="exit non-zero below this held-out accuracy")
    return parser.parse_args(argv)


def write_shards(directory: str, shards: int = 8) -> tuple[int, object, object]:
    """The digits as ``images-XXXXX.npy`` / ``labels-XXXXX.npy`` shards (4/5 of the rows) and the
    held-out fifth as arrays."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images.astype(np.uint8)  # 0..16
    labels = digits.target.astype(np.int32)
    split = len(images) * 4 // 5
    os.makedirs(directory, exist_ok=True)
    for index, rows in enumerate(np.array_split(np.arange(split), shards)):
        np.save(os.path.join(directory, f"images-{index:05d}.npy"), images[rows])
        np.save(os.path.join(directory, f"labels-{index:05d}.npy"), labels[rows])
    return split, images[split:], labels[split:]


class Shards:
    """Random access to the rows of the ``.npy`` shards in ``directory`` (memory-mapped: a row
    read touches only its bytes). Picklable, so grain's worker processes can open it too."""

    def __init__(self, directory: str):
        import numpy as np

        self.directory = directory
        names = sorted(n for n in os.listdir(directory) if n.startswith("images-"))
        sizes = [np.load(os.path.join(directory, n), mmap_mode="r").shape[0] for n in names]
        self.names, self.ends = names, np.cumsum(sizes)
        self._open = {}

    def __len__(self) -> int:
        return int(self.ends[-1])

    def __getitem__(self, index: int):
        import numpy as np

        shard = int(np.searchsorted(self.ends, index, side="right"))
        row = index - (int(self.ends[shard - 1]) if shard else 0)
        if shard not in self._open:
            name = self.names[shard]
            self._open[shard] = tuple(
                np.load(os.path.join(self.directory, prefix + name[len("images-") :]), mmap_mode="r")
                for prefix in ("images-", "labels-")
            )
        images, labels = self._open[shard]
        return np.asarray(images[row]), np.asarray(labels[row])

    def __getstate__(self):
        return {**self.__dict__, "_open": {}}  # memory maps are reopened in each worker


def decode(example):
    """uint8 pixels 0..16 -> float32 in [0, 1] with a channel axis; the label as it is."""
    import numpy as np

    image, label = example
    return (image.astype(np.float32) / 16.0)[..., None], label


def pipeline(directory: str, batch_size: int, workers: int):
    """An endless grain iterator of shuffled, decoded batches (reshuffled every epoch)."""
    import grain

    dataset = grain.MapDataset.source(Shards(directory)).shuffle(seed=0).repeat(None).map(decode)
    batches = dataset.to_iter_dataset().batch(batch_size)
    if workers:
        batches = batches.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return iter(batches)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import flax.linen as nn
    import jax
    import numpy as np
    import optax

    import trainkit as tk

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.relu(nn.Conv(16, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
            x = nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1)))
            return nn.Dense(10)(x)

    root = args.data_dir or tempfile.mkdtemp(prefix="trainkit-shards-")
    rows, held_out_x, held_out_y = write_shards(root)
    held_out = ((held_out_x.astype(np.float32) / 16.0)[..., None], held_out_y)
    print(f"wrote {rows} training rows as 8 shards in {root}")

    # One explicit strategy for all three runs: "auto" times its candidates, and on a busy
    # machine the resumed run may pick another one: exact, but not bit-identical.
    strategy = "dp" if len(jax.devices()) > 1 else "single"

    def trainer():
        return tk.Trainer(
            CNN(),
            loss="sparse_categorical_crossentropy",
            optimizer=optax.adam(3e-3),
            metrics=["accuracy"],
            seed=0,
            strategy=strategy,
        )

    def train(backup: str, interrupt_at: int | None = None):
        run = trainer()
        stop = tk.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs=None: (
                run.session.preempt() if interrupt_at and run.global_step == interrupt_at else None
            )
        )
        epoch = -(-rows // args.batch_size)
        batches = pipeline(root, args.batch_size, args.workers)
        try:
            run.fit(
                batches,
                epochs=-(-args.steps // epoch),
                steps_per_epoch=epoch,
                max_steps=args.steps,
                verbose=0,
                callbacks=[tk.callbacks.BackupAndRestore(backup, save_freq=20), stop],
            )
        finally:  # the pipeline is ours: stop its workers and free the batches they had prefetched
            batches.close()
        return run

    backup = os.path.join(root, "backup")
    try:
        train(backup, interrupt_at=args.interrupt_at)
        print("error: the run was not interrupted")
        return 1
    except tk.Preempted as stopped:
        print(f"interrupted: {stopped} (backup with the grain iterator's position in {backup})")
    resumed = train(backup)
    loss, accuracy = resumed.evaluate(held_out, batch_size=128)
    print(f"resumed and finished at step {resumed.global_step}: held-out loss {loss:.4f}, accuracy {accuracy:.4f}")
    failed = accuracy < args.min_accuracy
    if args.check_exact:
        straight = train(os.path.join(root, "backup-uninterrupted"))
        same = all(
            np.array_equal(a, b) for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(straight.params))
        )
        print(f"bit-identical to an uninterrupted run: {same}")
        failed = failed or not same
    if failed:
        print(f"error: accuracy below {args.min_accuracy} or the resumed run differs", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
