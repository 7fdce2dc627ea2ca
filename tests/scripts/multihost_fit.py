"""Trains the same model under several strategies in however many processes launched it, and
(on process 0) writes parameters, evaluation and predictions to an .npz for comparison.

    python -m trainkit.launch --nproc 2 --devices-per-proc 4 tests/scripts/multihost_fit.py out.npz
"""

import argparse
import os
import sys
import time

import trainkit as tk  # noqa: E402  (creating the Trainer connects the processes)


def training_data(kind, x, y):
    """``(data, fit options)`` of one adapter, or ``None`` when its library is not installed.
    Random-access sources are shuffled by trainkit (as arrays are). An iterator pipeline reads
    the first 96 rows (6 global batches of 16) unshuffled, each process its block of 16 / P rows
    of every global batch, so global batch ``k`` is the array path's batch ``k``, row for row (the
    dropout masks too)."""
    import importlib.util

    import jax
    import numpy as np

    p, count = jax.process_index(), jax.process_count()
    library = {"grain": "grain", "hf": "datasets", "torch": "torch", "tf": "tensorflow"}.get(kind.split("-")[0])
    if library and importlib.util.find_spec(library) is None:
        return None
    rows = [(x[i], y[i]) for i in range(len(x))]
    local = 16 // count
    mine = np.array([i for i in range(96) if (i % 16) // local == p])
    if kind == "arrays":
        return (x, y), {"batch_size": 16}
    if kind == "arrays-96-in-order":
        return (x[:96], y[:96]), {"batch_size": 16, "shuffle": False}
    if kind == "grain-map":
        import grain

        return grain.MapDataset.source(rows), {"batch_size": 16}
    if kind == "grain-iter":
        import grain

        mine_rows = [rows[i] for i in mine]
        return grain.MapDataset.source(mine_rows).to_iter_dataset().batch(local), {"shuffle": False}
    if kind == "hf":
        import datasets

        table = datasets.Dataset.from_dict({"features": x, "label": y})
        return tk.sources.HuggingFaceSource(table, x="features", y="label"), {"batch_size": 16}
    if kind == "torch-map":
        import torch

        return torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), {"batch_size": 16}
    if kind == "torch-loader":
        import torch

        local_rows = torch.utils.data.TensorDataset(torch.from_numpy(x[mine]), torch.from_numpy(y[mine]))
        return torch.utils.data.DataLoader(local_rows, batch_size=local), {"shuffle": False}
    if kind == "tf":
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices((x[mine], y[mine])).batch(local), {"shuffle": False}
    raise ValueError(f"unknown --data {kind}")


#: the strategies whose checkpoint and final weights ``--save`` writes (test_multihost reads these)
SAVED = ("dp", "fsdp")


class SlowRows:
    """The rows as a random-access source (shuffled and split as arrays are), each read taking
    ``delay`` seconds: a slow input pipeline."""

    def __init__(self, x, y, delay):
        self.x, self.y, self.delay = x, y, delay

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        time.sleep(self.delay)
        return self.x[index], self.y[index]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--strategies", default="dp,fsdp,hybrid")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--seed-by-process", action="store_true", help="a misconfiguration to catch")
    parser.add_argument("--rows-by-process", action="store_true", help="process 1 holds fewer rows")
    parser.add_argument("--die-at-step", type=int, default=0, help="process 1 kills itself at this step")
    parser.add_argument("--raise-at-step", type=int, default=0, help="process 1 raises at this step")
    parser.add_argument("--stall-at-step", type=int, default=0, help="process 1 sleeps in Python at this step")
    parser.add_argument("--gather-on-0-only", action="store_true", help="read trainer.params on process 0 only")
    parser.add_argument("--save", default="")
    parser.add_argument("--load", default="")
    parser.add_argument("--explicit-init", action="store_true")
    parser.add_argument("--tensorboard", default="", help="log each strategy's run to DIR/<strategy>")
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--data", default="", help="adapters to train with (dp only), e.g. grain-map,torch-loader")
    parser.add_argument("--slow-input-process", type=int, default=-1, help="dp reads its rows slowly on this process")
    args = parser.parse_args()
    if args.explicit_init:
        tk.distributed.initialize()

    import flax.linen as nn
    import jax
    import numpy as np
    import optax

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.relu(nn.Dense(32)(x))
            x = nn.Dropout(0.2, deterministic=not train)(x)
            return nn.Dense(3)(x)

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return h + nn.tanh(nn.Dense(32)(h)), None

    class StackedNet(nn.Module):  # blocks a pipeline splits: one nn.scan over 4 layers
        @nn.compact
        def __call__(self, x, train: bool = False):
            h = nn.Dense(32)(x)
            h, _ = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)()(h, None)
            return nn.Dense(3)(h)

    strategies = {
        "pipeline": lambda: tk.Hybrid(stage=2, fsdp=4, microbatches=4, min_shard_size=16),  # a stage per process
        "pipeline-iterable": lambda: tk.Hybrid(stage=2, fsdp=4, microbatches=4, min_shard_size=16),
        "single-stacked": lambda: "single",
        "dp": lambda: tk.DataParallel(),
        "fsdp": lambda: tk.FSDP(min_shard_size=16),
        "hybrid": lambda: tk.Hybrid(data=2, fsdp=4, min_shard_size=16),
        "auto": lambda: tk.strategies.Auto(always_compare=True),  # every candidate compiled, none skipped
    }
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 5)).astype(np.float32)  # batch 16: the last batch holds 4 rows
    y = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5)).astype(np.int32)
    seed = args.seed + (jax.process_index() if args.seed_by_process else 0)
    results = {}
    for kind in filter(None, args.data.split(",")):
        trainer = tk.Trainer(
            Net(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(0.01), strategy="dp", seed=seed
        )
        data = training_data(kind, x, y)
        if data is not None:
            trainer.fit(data[0], epochs=2, verbose=0, **data[1])
            for path, leaf in jax.tree_util.tree_leaves_with_path(trainer.params):
                results[f"{kind}/{jax.tree_util.keystr(path)}"] = leaf
    for name in filter(None, args.strategies.split(",")):
        trainer = tk.Trainer(
            StackedNet() if name.startswith(("pipeline", "single-stacked")) else Net(),
            loss="sparse_categorical_crossentropy",
            optimizer=optax.adam(0.01),
            metrics=["accuracy"],
            strategy=strategies[name](),
            seed=seed,
            steps_per_execution=args.steps_per_execution,
        )
        callbacks = []
        if args.tensorboard:  # every process passes the callback; only process 0 may write
            callbacks.append(tk.callbacks.TensorBoard(os.path.join(args.tensorboard, name)))
        if args.rows_by_process and jax.process_index() == 1:  # after the Trainer connected the processes
            x, y = x[:60], y[:60]
        if args.die_at_step:

            def die(batch, logs=None):
                if jax.process_index() == 1 and trainer.global_step >= args.die_at_step:  # noqa: B023
                    print("process 1 dies now", flush=True)
                    os.kill(os.getpid(), 9)

            callbacks.append(tk.callbacks.LambdaCallback(on_train_batch_begin=die))
        if args.raise_at_step:

            def fail(batch, logs=None):
                if jax.process_index() == 1 and trainer.global_step >= args.raise_at_step:  # noqa: B023
                    raise RuntimeError("process 1 fails on purpose")

            callbacks.append(tk.callbacks.LambdaCallback(on_train_batch_begin=fail))
        if args.stall_at_step:

            def stall(batch, logs=None):
                if jax.process_index() == 1 and trainer.global_step == args.stall_at_step:  # noqa: B023
                    time.sleep(300)

            callbacks.append(tk.callbacks.LambdaCallback(on_train_batch_begin=stall))
        saves = bool(args.save) and name in SAVED  # the strategies the tests resume or read
        if saves:  # a checkpoint after epoch 2 of 3, on every process

            def save(epoch, logs=None):
                if epoch == 1:
                    trainer.save(os.path.join(args.save, name))  # noqa: B023

            callbacks.append(tk.callbacks.LambdaCallback(on_epoch_end=save))
        if args.load:  # a checkpoint of --save: its epoch 3
            trainer.init((x, y))
            trainer.load(os.path.join(args.load, name))
            trainer.fit((x, y), batch_size=16, epochs=3, initial_epoch=2, verbose=1)
        else:
            data, read_ahead = (x, y), True
            if name.endswith("-iterable"):  # each process its own batches of 8 rows
                data = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 96, 8)]
            if name == "dp" and args.slow_input_process >= 0:  # the same rows; one process reads them slowly
                delay = 0.004 if jax.process_index() == args.slow_input_process else 0.0
                data = tk.sources.RandomAccessSource(SlowRows(x, y, delay))
                read_ahead = False  # every read in the loop's thread: a slow step (2 cores) never hides it
            history = trainer.fit(
                data,
                batch_size=None if name.endswith("-iterable") else 16,
                epochs=3,
                verbose=1,
                callbacks=callbacks,
                read_ahead=read_ahead,
            )
            results[f"{name}/loss"] = np.asarray(history.history["loss"])
            if saves:  # and its final weights, written by every process together
                trainer.save_weights(os.path.join(args.save, f"{name}.safetensors"))
        if name == "auto" and jax.process_index() == 0:
            rows = "; ".join(f"{r.name}={r.error or r.skipped or 'compiled'}" for r in trainer.last_plan.rows)
            print(f"plan rows: {rows}", flush=True)
        if args.gather_on_0_only:
            if jax.process_index() == 0:
                trainer.params  # noqa: B018 - the mistake under test
            time.sleep(30)  # process 1 does something else meanwhile
        results[f"{name}/eval"] = np.asarray(trainer.evaluate((x, y), batch_size=24))
        results[f"{name}/predict"] = trainer.predict(x, batch_size=24)
        for path, leaf in jax.tree_util.tree_leaves_with_path(trainer.params):
            results[f"{name}/{jax.tree_util.keystr(path)}"] = leaf
    print(f"process {jax.process_index()} of {jax.process_count()} done", flush=True)
    if jax.process_index() == 0:
        np.savez(args.out, **results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
