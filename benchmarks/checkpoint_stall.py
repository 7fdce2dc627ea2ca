"""How long an asynchronous checkpoint stalls training, in steps of the benchmark models.

``fit`` runs the same steps with ``ModelCheckpoint(save_freq=N)`` and with a
``ModelCheckpoint`` that never fires (same set-up and close), alternating over repeats in one
run; the stall of one save is the extra time divided by the number of saves, in units of one
training step. A synchronous save (``Trainer.save`` every N steps) is the comparison, and the
fixed cost of opening and closing a checkpoint directory is shown too. "async blocks" is the
time the training thread spends inside one asynchronous save; "async stall" is the whole
slowdown, which on a 2-core CPU machine is mostly the background write competing with XLA for
the same two cores.

    python benchmarks/checkpoint_stall.py [--steps 60] [--every 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import optax  # noqa: E402
from step_overhead import CASES, dataset  # noqa: E402

import trainkit as tk  # noqa: E402


class TimedCheckpoint(tk.callbacks.ModelCheckpoint):
    """ModelCheckpoint that records how long the training thread spends in each save call."""

    blocked: list = []

    def _write(self, filepath):
        start = time.perf_counter()
        super()._write(filepath)
        TimedCheckpoint.blocked.append(time.perf_counter() - start)


class SyncSave(tk.callbacks.Callback):
    """The comparison: a blocking ``trainer.save`` every N steps."""

    def __init__(self, directory, every):
        self.directory, self.every = directory, every

    def on_train_batch_end(self, batch, logs=None):
        step = self.trainer.global_step
        if step % self.every == 0:
            self.trainer.save(self.directory, max_to_keep=2)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="trainkit-stall-")
    saves = args.steps // args.every  # after steps every, 2*every, ...
    print(
        f"{args.steps} steps, a save every {args.every} steps ({saves} saves per run), "
        f"median of {args.repeats} alternating repeats; stall in units of one step\n"
    )
    print(
        f"{'model':5} {'state MiB':>9} {'step ms':>8} {'async blocks':>14} {'async stall':>12} "
        f"{'sync stall':>11} {'open+close':>13}"
    )
    for case, (model_cls, shape, batch_size) in CASES.items():
        x, y = dataset(shape, batch_size, args.steps)
        trainer = tk.Trainer(
            model_cls(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3), strategy=tk.SingleDevice()
        )
        trainer.fit((x, y), batch_size=batch_size, epochs=1, verbose=0)  # compile

        def run(callbacks):
            start = time.perf_counter()
            trainer.fit((x, y), batch_size=batch_size, epochs=1, verbose=0, callbacks=callbacks)  # noqa: B023 - called within the iteration
            return time.perf_counter() - start

        times = {"plain": [], "idle": [], "async": [], "sync": []}
        TimedCheckpoint.blocked = []
        for repeat in range(args.repeats):
            for name in times:
                directory = os.path.join(root, f"{case}-{name}-{repeat}")
                callbacks = {
                    "plain": [],
                    "idle": [tk.callbacks.ModelCheckpoint(directory, monitor="loss", save_freq=10**9, max_to_keep=2)],
                    "async": [TimedCheckpoint(directory, monitor="loss", save_freq=args.every, max_to_keep=2)],
                    "sync": [
                        SyncSave(directory, args.every),
                        tk.callbacks.ModelCheckpoint(directory + "-idle", monitor="loss", save_freq=10**9),
                    ],
                }[name]
                times[name].append(run(callbacks))
                shutil.rmtree(directory, ignore_errors=True)
        plain = statistics.median(times["plain"])
        step = plain / args.steps
        state_mib = sum(a.nbytes for a in __import__("jax").tree.leaves(trainer.state)) / 2**20
        idle = statistics.median(times["idle"])
        stall = {k: (statistics.median(times[k]) - idle) / saves / step for k in ("async", "sync")}
        fixed = (idle - plain) / step
        blocked = statistics.median(TimedCheckpoint.blocked) / step
        print(
            f"{case:5} {state_mib:9.1f} {step * 1e3:8.2f} {blocked:14.2f} {stall['async']:12.2f} "
            f"{stall['sync']:11.2f} {fixed:13.1f}"
        )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
