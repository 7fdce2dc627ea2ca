"""One training script for every engine (trainkit's launcher, srun, mpirun, a Ray Train worker):
it never calls ``tk.distributed.initialize()``; creating the Trainer joins the job. Trains a small
MLP for 48 steps (12 per epoch) under DataParallel and FSDP and, on process 0, writes each
strategy's final parameters, losses and the goodput ledger's lost steps to OUT.npz.

    srun -n2 python tests/scripts/engine_fit.py OUT.npz
    python -m trainkit.launch --nproc 2 --devices-per-proc 2 tests/scripts/engine_fit.py OUT.npz

``--backup DIR`` adds ``BackupAndRestore(DIR/<strategy>, save_freq=4)``; ``--die-at STEP`` makes
process 1 die (SIGKILL, or ``os._exit(1)`` with ``--exit``) at that step, once per ``--once FILE``
(the file is written before dying: a restarted run trains through; with ``--backup`` it dies once
the previous backup is on disk, so a resume loses exactly the steps since); ``--visible-devices`` prints
the GPUs each process was given (JAX's ``jax_cuda_visible_devices``) and trains nothing.

Under Ray Train only (``train``'s arguments): ``fresh_backup`` puts each worker group's backups in a
folder of its own (a fresh machine's: only Ray's checkpoint can resume it; process 1 dies once Ray's
controller has recorded the backup before ``die_at``); ``drain_at`` makes rank
0 announce its node's preemption (``ray drain-node``) at that step, and the steps after it wait
0.1 s each so that Ray's notice arrives within the fit.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time


def train(out: str, strategies: str = "dp,fsdp", backup: str = "", die_at: int = 0, exit_code: bool = False,
          once: str = "", save_freq: int | str = 4, fresh_backup: bool = False, drain_at: int = 0) -> dict:  # fmt: skip
    import flax.linen as nn
    import numpy as np
    import optax

    import trainkit as tk

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.relu(nn.Dense(32)(x))
            x = nn.Dropout(0.2, deterministic=not train)(x)
            return nn.Dense(3)(x)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(192, 5)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5)).astype(np.int32)
    make = {"dp": lambda: tk.DataParallel(), "fsdp": lambda: tk.FSDP(min_shard_size=16)}
    results: dict = {}
    if fresh_backup:  # this worker group's own folder, as on fresh machines
        import uuid

        from ray.train.collective import broadcast_from_rank_zero

        backup = os.path.join(backup, broadcast_from_rank_zero(uuid.uuid4().hex))
    for name in strategies.split(","):
        trainer = tk.Trainer(
            Net(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(0.01), strategy=make[name](), seed=3
        )
        import jax

        callbacks: list = []
        if backup:
            saves = tk.callbacks.BackupAndRestore(os.path.join(backup, name), save_freq=save_freq)
            saves.journal_seconds = 0  # the goodput journal at every step: the lost steps counted exactly
            callbacks.append(saves)
        if drain_at:
            callbacks += [tk.callbacks.RayTrainReport(check_seconds=0), drain(drain_at, lambda: trainer.global_step)]  # noqa: B023
        if die_at:

            def die(batch, logs=None):
                if jax.process_index() == 1 and trainer.global_step == die_at and not (once and os.path.exists(once)):  # noqa: B023
                    if backup:  # the backup of the step before is on disk, not still being written
                        written = os.path.join(backup, name, str(die_at - die_at % 4))  # noqa: B023
                        deadline = time.monotonic() + 120
                        while not os.path.isdir(written) and time.monotonic() < deadline:
                            time.sleep(0.05)
                    if fresh_backup:  # and Ray's controller has recorded it (reports are registered as it polls)
                        import ray.train

                        ray.train.get_all_reported_checkpoints()
                    if once:
                        pathlib.Path(once).write_text("died once")
                    print(f"process 1 dies now at {time.time():.3f}", flush=True)
                    os._exit(1) if exit_code else os.kill(os.getpid(), 9)

            callbacks.append(tk.callbacks.LambdaCallback(on_train_batch_begin=die))

        def first(batch, logs=None):
            if trainer.global_step == 1 and jax.process_index() == 0:  # noqa: B023
                print(f"first step done at {time.time():.3f}", flush=True)

        callbacks.append(tk.callbacks.LambdaCallback(on_train_batch_end=first))
        history = trainer.fit((x, y), batch_size=16, epochs=4, verbose=0, callbacks=callbacks)
        results[f"{name}/loss"] = np.asarray(history.history["loss"])
        results[f"{name}/lost_steps"] = np.asarray(history.goodput.lost_steps)
        if backup:
            results[f"{name}/restored_step"] = np.asarray(-1 if saves.restored_step is None else saves.restored_step)
        for path, leaf in jax.tree_util.tree_leaves_with_path(trainer.params):
            results[f"{name}/{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    print(f"process {jax.process_index()} of {jax.process_count()} done", flush=True)
    if jax.process_index() == 0 and out:
        np.savez(out, **results)
    return results


def drain(at: int, step):
    """A callback: at step ``at``, rank 0 tells Ray its node is being reclaimed (``ray drain-node``
    with reason preemption, an hour's deadline); from then on each step waits 0.1 s."""
    import subprocess

    import jax
    import ray

    import trainkit as tk

    def on_train_batch_begin(batch, logs=None):
        if step() == at and jax.process_index() == 0:
            context = ray.get_runtime_context()
            command = [os.path.join(os.path.dirname(sys.executable), "ray"), "drain-node", "--address"]
            command += [context.gcs_address, "--node-id", context.get_node_id(), "--reason"]
            command += ["DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot reclaim (test)"]
            subprocess.run([*command, "--deadline-remaining-seconds", "3600"], check=True)
            print(f"node drained at step {at}", flush=True)
        if step() >= at:
            time.sleep(0.1)

    return tk.callbacks.LambdaCallback(on_train_batch_begin=on_train_batch_begin)


def visible_devices() -> None:
    import trainkit as tk

    tk.distributed.initialize()
    import jax

    print(f"process {jax.process_index()} visible devices {jax.config.read('jax_cuda_visible_devices')}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="")
    parser.add_argument("--strategies", default="dp,fsdp")
    parser.add_argument("--backup", default="")
    parser.add_argument("--die-at", type=int, default=0)
    parser.add_argument("--exit", action="store_true", help="die with os._exit(1) instead of SIGKILL")
    parser.add_argument("--once", default="")
    parser.add_argument("--visible-devices", action="store_true")
    args = parser.parse_args(argv)
    if args.visible_devices:
        visible_devices()
    else:
        train(args.out, args.strategies, args.backup, args.die_at, args.exit, args.once)
    return 0


if __name__ == "__main__":
    sys.exit(main())
