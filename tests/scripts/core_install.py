"""What ``pip install trainkit`` (no extras) must run, in a fresh virtual environment: a fit, a
save and a load of the checkpoint, saved and loaded weights (a file, and a sharded ``save_pretrained``
folder, unchecked without ``transformers``), and the default ``"jax"`` export
served back. ``.ci/run`` runs it after installing trainkit alone; exits non-zero on any error.

    python -m venv /tmp/core && /tmp/core/bin/pip install . && /tmp/core/bin/python tests/scripts/core_install.py
"""

import os
import sys
import tempfile

import flax.linen as nn
import numpy as np
import optax

import trainkit as tk


def main() -> int:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    trainer = tk.Trainer(nn.Dense(2), loss="sparse_categorical_crossentropy", optimizer=optax.adam(0.05))
    history = trainer.fit(x, y, batch_size=16, epochs=2, verbose=0)
    out = tempfile.mkdtemp(prefix="core-install-")
    trainer.save(os.path.join(out, "checkpoint"))
    again = tk.Trainer(nn.Dense(2), loss="sparse_categorical_crossentropy", optimizer=optax.adam(0.05))
    again.init(x[:16])
    again.load(os.path.join(out, "checkpoint"))
    trainer.save_weights(os.path.join(out, "weights.safetensors"))
    tk.weights.load(os.path.join(out, "weights.safetensors"), into=again)
    # without transformers nothing is checked against the architecture: the folder is written as named
    config = {"model_type": "custom", "architectures": ["CustomModel"], "hidden_size": 2}
    trainer.save_pretrained(os.path.join(out, "served"), config=config, max_shard_size=20)
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(os.listdir(os.path.join(out, "served"))) == ["config.json", *shards, "model.safetensors.index.json"]
    tk.weights.load(os.path.join(out, "served"), into=again)
    trainer.export(os.path.join(out, "model.jax"), verbose=False)
    served = np.asarray(tk.export.load(os.path.join(out, "model.jax"))(x[:5]))
    np.testing.assert_allclose(served, again.predict(x[:5], batch_size=8), atol=1e-5)
    print(
        f"core install: fit (loss {history.history['loss'][-1]:.3f}), save, load, weights, save_pretrained, export: ok"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
