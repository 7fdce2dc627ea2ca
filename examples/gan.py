"""A GAN on scikit-learn's digits: a train step of your own, alternating the discriminator's
update and the generator's, each with its own optimizer, under any strategy.

    python examples/gan.py --devices 8 --strategy dp      # DataParallel on 8 fake CPU devices

The model is one Flax module with two parts (``generator`` and ``discriminator``, reached with
``self.apply(..., method="generate")``); ``optimizer={"generator": ..., "discriminator": ...}``
gives each part its own Adam (keys are regexes matched against parameter paths). The step is
Keras's "Customizing what happens in fit()" GAN in trainkit's shape, written once as a ``tk.Step``
value (``GANStep``; ``--step-value`` trains with ``Trainer(step=GANStep())``), which the
``train_step`` override (Keras's habit) calls: ``state.normal`` draws the noise per row (the same
on any device count), ``state.mean`` reduces over the global batch's real rows,
``state.apply_gradients(grads, "discriminator")`` updates one group. ``fit``,
callbacks, ``steps_per_execution`` and ``BackupAndRestore`` (``--backup``) work as for the
built-in step. The script prints how far the generated digits' mean image is from the real
one before and after training, and exits non-zero when a loss is not finite or the gap did not
shrink by ``--min-improvement`` (a half by default).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import trainkit as tk

LATENT = 16


class MLP(nn.Module):
    """Dense layers of ``sizes`` with leaky ReLUs between them."""

    sizes: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        for size in self.sizes[:-1]:
            x = nn.leaky_relu(nn.Dense(size)(x), 0.2)
        return nn.Dense(self.sizes[-1])(x)


class GAN(nn.Module):
    """A generator of 8x8 digits (64 values in [-1, 1]) from ``LATENT`` noise, and a discriminator
    of real against generated digits (a logit per row)."""

    pixels: int = 64

    def setup(self):
        self.generator = MLP((64, self.pixels))
        self.discriminator = MLP((64, 1))

    def generate(self, z):
        return jnp.tanh(self.generator(z))

    def discriminate(self, images):
        return self.discriminator(images)[:, 0]

    def __call__(self, images):  # what init traces: both parts, so that both get parameters
        return self.discriminate(images), self.generate(jnp.zeros((images.shape[0], LATENT), images.dtype))


def bce(logits, label: float):
    return optax.sigmoid_binary_cross_entropy(logits, jnp.full_like(logits, label))


@dataclasses.dataclass(frozen=True)
class GANStep(tk.Step):
    """The GAN's step as a value: its hyperparameters are its fields (a changed one is a new value,
    traced again), and it cannot keep a value of one trace on itself (it is frozen)."""

    latent: int = LATENT

    def train(self, state, batch, rng):
        z = state.normal(rng, batch, (self.latent,))  # one draw per row, whatever the device count

        def run(params, x, method):
            return state.apply(params, state.model_state, x, rng=rng, train=True, method=method)[0]

        def d_loss_fn(params):
            fake = jax.lax.stop_gradient(run(params, z, "generate"))
            real_loss = bce(run(params, batch["x"], "discriminate"), 1.0)
            return state.mean(real_loss + bce(run(params, fake, "discriminate"), 0.0), batch)

        d_loss, grads = jax.value_and_grad(d_loss_fn)(state.params)
        state = state.apply_gradients(grads, "discriminator")  # the generator sees the updated discriminator

        def g_loss_fn(params):
            return state.mean(bce(run(params, run(params, z, "generate"), "discriminate"), 1.0), batch)

        g_loss, grads = jax.value_and_grad(g_loss_fn)(state.params)
        state = state.apply_gradients(grads, "generator")
        return state, {"d_loss": d_loss, "g_loss": g_loss}


class GANTrainer(tk.Trainer):
    """The same GAN in Keras's habit, a ``train_step`` override (which trainkit runs as a step value too)."""

    latent = LATENT

    def train_step(self, state, batch, rng):
        return GANStep(self.latent).train(state, batch, rng)


def digits(rows: int | None = None) -> np.ndarray:
    """scikit-learn's 8x8 digits as rows of 64 values in [-1, 1] (the first ``rows`` of them)."""
    from sklearn.datasets import load_digits

    images = (load_digits().data / 8.0 - 1.0).astype(np.float32)
    return images if rows is None else images[:rows]


def mean_image_gap(trainer: tk.Trainer, images: np.ndarray, samples: int = 512) -> float:
    """The mean absolute difference between the mean generated digit (from fixed noise) and the
    mean real one: what a generator that learned nothing gets wrong first."""
    state = trainer.state
    z = jax.random.normal(jax.random.key(1), (samples, LATENT))
    fake, _ = trainer.apply(state.params, state.model_state, z, rng=state.rng, train=False, method="generate")
    return float(np.abs(np.asarray(fake).mean(axis=0) - images.mean(axis=0)).mean())


def make_trainer(
    strategy: str = "single", learning_rate: float = 1e-3, step_value: bool = False, **options
) -> tk.Trainer:
    """The GAN's trainer: its ``train_step`` override, or with ``step_value`` a ``tk.Trainer`` given ``GANStep()``."""
    strategies = {"single": tk.SingleDevice, "dp": tk.DataParallel, "fsdp": tk.FSDP}
    made = tk.Hybrid(data=2, fsdp=4) if strategy == "hybrid" else strategies[strategy]()
    adam = optax.adam(learning_rate, b1=0.5)
    optimizer = {"generator": adam, "discriminator": adam}
    if step_value:
        return tk.Trainer(GAN(), optimizer=optimizer, strategy=made, step=GANStep(), **options)
    return GANTrainer(GAN(), optimizer=optimizer, strategy=made, **options)


class Sleep(tk.callbacks.Callback):
    """Sleeps after each batch (a slow run to interrupt, for the resume test)."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=0, help="fake this many CPU devices (0: the real ones)")
    parser.add_argument("--strategy", default="single", choices=["single", "dp", "fsdp", "hybrid"])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--rows", type=int, default=None, help="train on the first ROWS digits (all by default)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps-per-execution", type=int, default=None)
    parser.add_argument("--backup", type=pathlib.Path, default=None, help="BackupAndRestore into this folder")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="save the final parameters (.npz)")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each batch")
    parser.add_argument("--min-improvement", type=float, default=0.5, help="the mean-image gap's least shrinkage")
    parser.add_argument("--step-value", action="store_true", help="train with GANStep() given as step=")
    parser.add_argument("--verbose", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.devices:
        jax.config.update("jax_num_cpu_devices", args.devices)  # before anything touches a device
    trainer = make_trainer(args.strategy, step_value=args.step_value, steps_per_execution=args.steps_per_execution)
    callbacks: list[tk.callbacks.Callback] = [Sleep(args.sleep)] if args.sleep else []
    if args.backup is not None:
        callbacks.append(tk.callbacks.BackupAndRestore(str(args.backup), save_freq=1))
    images = digits(args.rows)
    trainer.init(images)
    before = mean_image_gap(trainer, images)
    history = trainer.fit(images, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks,
                          verbose=args.verbose)  # fmt: skip
    d_loss, g_loss = history.history["d_loss"][-1], history.history["g_loss"][-1]
    print(f"trained {args.epochs} epochs under {trainer.strategy.describe()}: d_loss {d_loss:.4f}, g_loss {g_loss:.4f}")
    after = mean_image_gap(trainer, images)
    print(f"the mean generated digit is {after:.3f} from the real one's (before training: {before:.3f})")
    if args.out is not None:
        leaves = jax.tree_util.tree_leaves_with_path(trainer.params)
        np.savez(args.out, **{jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves})
    return 0 if np.isfinite([d_loss, g_loss]).all() and after <= (1 - args.min_improvement) * before else 1


if __name__ == "__main__":
    sys.exit(main())
