"""Which rule turns a learning-rate range test into a good rate? One range test per model and
optimizer (the digits CNN of ``examples/digits_cnn.py`` and an MLP on the same digits, each
with Adam and with SGD + momentum), then each rule's suggestion trained for a few epochs from
the same initial weights, its test accuracy set against a grid of fixed rates. The rules:
``steep`` (Lightning's: the steepest descent of the smoothed loss), ``min/10`` (fastai's
``lr_min``: the rate of the lowest smoothed loss, divided by 10) and ``valley`` (fastai's
default: two thirds of the way down the longest descending stretch).

    python benchmarks/lr_rules.py [--epochs 5]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "1")

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import trainkit as tk  # noqa: E402
from trainkit.callbacks import lr_finder  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import CNN  # noqa: E402  - the digits example's CNN


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(128)(x.reshape(x.shape[0], -1))))


OPTIMIZERS = {"adam": optax.adam, "sgd+momentum": lambda learning_rate: optax.sgd(learning_rate, momentum=0.9)}
GRID = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1)


def digits():
    data = load_digits()
    images, labels = (data.images / 16.0).astype(np.float32)[..., None], data.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(labels))
    fifth = len(labels) // 5
    return (images[order[fifth:]], labels[order[fifth:]]), (images[order[:fifth]], labels[order[:fifth]])


def trainer_for(model, optimizer, lr):
    return tk.Trainer(
        model(),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.inject_hyperparams(OPTIMIZERS[optimizer])(learning_rate=lr),
        metrics=["accuracy"],
        strategy="single",
        seed=0,
    )


def accuracy_at(model, optimizer, lr, train, test, epochs):
    trainer = trainer_for(model, optimizer, lr)
    trainer.fit(*train, batch_size=64, epochs=epochs, verbose=0)
    return trainer.evaluate(*test, batch_size=256, return_dict=True)["accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    train, test = digits()
    print(f"| model, optimizer | best grid rate (accuracy) | {' | '.join(lr_finder.RULES)} |")
    print("|---|---|" + "---|" * len(lr_finder.RULES))
    for model in (CNN, MLP):
        for optimizer in OPTIMIZERS:
            search = trainer_for(model, optimizer, 1e-3).find_learning_rate(*train, batch_size=64, steps=100)
            grid = {lr: accuracy_at(model, optimizer, lr, train, test, args.epochs) for lr in GRID}
            best = max(grid, key=grid.__getitem__)
            cells = []
            for rule in lr_finder.RULES:
                rate = lr_finder.suggest_by(rule, search.lrs, search.losses)
                shown = (
                    "none"
                    if rate is None
                    else f"{rate:.3g} ({accuracy_at(model, optimizer, rate, train, test, args.epochs):.3f})"
                )
                cells.append(shown)
            print(f"| {model.__name__}, {optimizer} | {best:g} ({grid[best]:.3f}) | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
