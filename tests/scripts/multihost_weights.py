"""Loads a safetensors file into an FSDP trainer in however many processes launched it; each
process counts the bytes it read from the file and the bytes its devices hold; process 0 writes
the loaded values (gathered) to an .npz.

    python -m trainkit.launch --nproc 2 --devices-per-proc 4 tests/scripts/multihost_weights.py W.safetensors OUT.npz
"""

import json
import sys

import flax.linen as nn
import jax
import numpy as np
import optax

import trainkit as tk
from trainkit.weights.sources import SafetensorsSource


class Wide(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="head")(nn.relu(nn.Dense(256, name="hidden")(x)))


def main(weights, out):
    read = []
    original = SafetensorsSource.read

    def counted(self, name, index):
        part = original(self, name, index)
        read.append(part.nbytes)
        return part

    SafetensorsSource.read = counted
    trainer = tk.Trainer(
        Wide(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3), strategy=tk.FSDP(min_shard_size=1)
    )
    trainer.init(np.zeros((8, 64), np.float32))
    report = tk.weights.load(weights, into=trainer)
    held = sum(s.data.nbytes for leaf in jax.tree.leaves(trainer.state.params) for s in leaf.addressable_shards)
    print(f"process {jax.process_index()}: " + json.dumps({"read": sum(read), "held": held}), flush=True)
    weights = trainer.get_weights()  # every process takes part in the gather
    if jax.process_index() == 0:
        flat = {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(weights)}
        np.savez(out, **flat)
        print(f"loaded {len(report.loaded)} variables", flush=True)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
