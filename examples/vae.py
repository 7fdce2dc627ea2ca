"""A variational auto-encoder on scikit-learn's digits: a ``compute_loss`` that logs its parts.

    python examples/vae.py --devices 8 --strategy dp

``compute_loss`` returns the loss per row and, beside the predictions and the model state, a
dict of its parts per row: ``reconstruction_loss`` (keras-io's VAE: the pixels' binary
cross-entropy, summed) and ``kl_loss`` are reduced as the loss is and logged in History
(``val_kl_loss`` in validation) on any strategy. The module has two parts, reached with
``self.apply(..., method="encode")`` and ``method="decode"``; ``batch.normal`` draws the noise
per row, so the numbers are the same on one device and on eight. The script exits
non-zero unless the held-out reconstruction beats the mean image's by ``--min-gain``.
"""

from __future__ import annotations

import argparse
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import trainkit as tk


class VAE(nn.Module):
    """64 values through a latent of ``latent`` dimensions, ``encode`` and ``decode`` apart."""

    latent: int = 2

    def setup(self):
        self.hidden, self.mean, self.log_var = nn.Dense(64), nn.Dense(self.latent), nn.Dense(self.latent)
        self.out_hidden, self.out = nn.Dense(64), nn.Dense(64)

    def encode(self, x):
        hidden = nn.relu(self.hidden(x))
        return self.mean(hidden), self.log_var(hidden)

    def decode(self, z):  # logits of the 64 values
        return self.out(nn.relu(self.out_hidden(z)))

    def __call__(self, x):  # predict and export: the reconstruction of the mean code
        return jax.nn.sigmoid(self.decode(self.encode(x)[0]))


class VAETrainer(tk.Trainer):
    def compute_loss(self, params, batch, rng, *, model_state, train):
        (mean, log_var), _ = self.apply(params, model_state, batch["x"], rng=rng, train=train, method="encode")
        z = mean + jnp.exp(0.5 * log_var) * batch.normal(rng, mean.shape[1:]) if train else mean
        logits, model_state = self.apply(params, model_state, z, rng=rng, train=train, method="decode")
        reconstruction_loss = optax.sigmoid_binary_cross_entropy(logits, batch["x"]).sum(axis=-1)
        kl_loss = -0.5 * (1 + log_var - mean**2 - jnp.exp(log_var)).sum(axis=-1)
        logs = {"reconstruction_loss": reconstruction_loss, "kl_loss": kl_loss}
        return reconstruction_loss + kl_loss, (logits, model_state, logs)


def digits(rows: int | None = None) -> np.ndarray:
    """scikit-learn's 8x8 digits as rows of 64 values in [0, 1], shuffled (the first ``rows``)."""
    from sklearn.datasets import load_digits

    images = (load_digits().data / 16.0).astype(np.float32)
    images = images[np.random.default_rng(0).permutation(len(images))]
    return images if rows is None else images[:rows]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=0, help="fake this many CPU devices (0: the real ones)")
    parser.add_argument("--strategy", default="single", choices=["single", "dp", "fsdp"])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--min-gain", type=float, default=0.3, help="exit non-zero below this gain over the mean")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.devices:
        jax.config.update("jax_num_cpu_devices", args.devices)  # before anything touches a device
    images = digits()
    split = int(0.8 * len(images))
    train, held_out = images[:split], images[split:]
    trainer = VAETrainer(VAE(), optimizer=optax.adam(3e-3), strategy=args.strategy)
    history = trainer.fit(train, batch_size=64, epochs=args.epochs, validation_data=(held_out,), verbose=0)
    logs = {key: round(values[-1], 4) for key, values in sorted(history.history.items())}
    print("last epoch:", logs)
    baseline = ((held_out - train.mean(axis=0)) ** 2).sum(axis=-1).mean()  # always the mean image
    reconstruction = ((trainer.predict(held_out) - held_out) ** 2).sum(axis=-1).mean()
    gain = 1 - reconstruction / baseline
    print(
        f"held-out reconstruction error {reconstruction:.3f} against the mean image's {baseline:.3f}: gain {gain:.2f}"
    )
    return 0 if gain >= args.min_gain else 1


if __name__ == "__main__":
    sys.exit(main())
