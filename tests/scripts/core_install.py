"""What ``pip install trainkit`` (no extras) must run, in a fresh virtual environment: a fit, a
save and a load of the checkpoint, saved and loaded weights, and the default ``"jax"`` export
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
    trainer.export(os.path.join(out, "model.jax"), verbose=False)
    served = np.asarray(tk.export.load(os.path.join(out, "model.jax"))(x[:5]))
    np.testing.assert_allclose(served, again.predict(x[:5], batch_size=8), atol=1e-5)
    print(f"core install: fit (loss {history.history['loss'][-1]:.3f}), save, load, weights, export: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
