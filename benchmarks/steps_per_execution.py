"""Dispatch-bound training: ``steps_per_execution=k`` against k=1, Keras 3 and a hand-written loop.

A model whose step is far shorter than one Python dispatch (an MLP 32-64-10, batch 32, one
device) spends its time in the host loop. trainkit's ``steps_per_execution=k`` runs k steps in
one compiled call (a ``lax.scan``); Keras 3's JAX backend, given the same setting, runs the
callbacks once per k steps but still dispatches one compiled step per batch. Same data, same
optimizer (Adam), one shuffled epoch per repeat, alternating repeats, medians; reported as
ratios measured side by side in one run. The hand-written rows are a plain optax loop: jitted
one step per call, and a jitted ``lax.scan`` over k stacked batches.

    python benchmarks/steps_per_execution.py [--repeats 5] [--steps 1024] [--k 32]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from timing import measure  # noqa: E402

import trainkit as tk  # noqa: E402

FEATURES, HIDDEN, CLASSES, BATCH = 32, 64, 10, 32


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(CLASSES)(nn.relu(nn.Dense(HIDDEN)(x)))


def dataset(steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = BATCH * steps
    return rng.normal(size=(n, FEATURES)).astype(np.float32), rng.integers(0, CLASSES, n).astype(np.int32)


def make_trainer(k) -> tk.Trainer:
    """The benchmark's trainer with ``steps_per_execution=k`` (``None``: the default)."""
    return tk.Trainer(
        MLP(),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.adam(1e-3),
        strategy="single",
        steps_per_execution=k,
    )


def trainkit_fit(x, y, k, callbacks=(), **options):
    """One epoch of ``fit`` per call (``options``: more of ``fit``'s arguments, e.g. ``data_on_device=True``)."""
    trainer = make_trainer(k)
    return lambda: trainer.fit((x, y), batch_size=BATCH, epochs=1, verbose=0, callbacks=list(callbacks), **options)


def keras_fit(x, y, k: int):
    try:
        import keras
    except ImportError:
        return None
    keras.utils.set_random_seed(0)
    keras.distribution.set_distribution(None)  # one device (an earlier benchmark may have set DataParallel)
    layers = keras.layers
    model = keras.Sequential([keras.Input((FEATURES,)), layers.Dense(HIDDEN, activation="relu"), layers.Dense(CLASSES)])
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=k,
    )
    return lambda: model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=True)


def hand_written(x, y, k: int):
    """A plain optax loop over shuffled batches: one jitted step per call (``k == 1``) or a
    jitted ``lax.scan`` over ``k`` stacked batches; the state donated, the epoch's loss total
    kept on the device in the step (read once, at the end), at most 2 calls in flight."""
    model, tx = MLP(), optax.adam(1e-3)
    params = model.init(jax.random.PRNGKey(0), x[:1])["params"]

    def step(carry, batch):
        (params, opt_state), total = carry
        xb, yb = batch

        def loss_fn(params):
            logits = model.apply({"params": params}, xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return ((optax.apply_updates(params, updates), opt_state), total + loss), None

    if k == 1:
        call = jax.jit(lambda state, total, batch: step((state, total), batch)[0], donate_argnums=(0,))
    else:
        call = jax.jit(
            lambda state, total, batches: jax.lax.scan(step, (state, total), batches)[0], donate_argnums=(0,)
        )
    box = {"state": (params, tx.init(params)), "epoch": 0}

    def run():
        carry, pending = (box["state"], np.float32(0)), []
        order = np.random.default_rng([0, box["epoch"]]).permutation(len(x)).reshape(-1, BATCH)
        for group in range(0, len(order), k):
            rows = order[group : group + k]
            batch = (x[rows], y[rows]) if k > 1 else (x[rows[0]], y[rows[0]])
            carry = call(*carry, batch)  # the state donated, the total kept
            pending.append(carry[1])
            if len(pending) > 2:
                pending.pop(0).block_until_ready()
        np.asarray(carry[1])  # the epoch's loss total, read once
        box["state"], box["epoch"] = carry[0], box["epoch"] + 1

    return run


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1024, help="steps per epoch (a multiple of --k)")
    parser.add_argument("--k", type=int, default=32)
    args = parser.parse_args()
    k = args.k
    x, y = dataset(args.steps)
    contenders = {
        "hand-written jit, 1 step per call": hand_written(x, y, 1),
        f"hand-written scan, {k} steps per call": hand_written(x, y, k),
        "trainkit steps_per_execution=1": trainkit_fit(x, y, 1),
        f"trainkit steps_per_execution={k}": trainkit_fit(x, y, k),
        f"trainkit k={k}, data_on_device": trainkit_fit(x, y, k, data_on_device=True),
    }
    for steps in (1, k):
        keras_run = keras_fit(x, y, steps)
        if keras_run is not None:
            contenders[f"keras steps_per_execution={steps}"] = keras_run
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform} x1, {os.cpu_count()} cores; MLP {FEATURES}-{HIDDEN}-"
        f"{CLASSES}, batch {BATCH}, {args.steps} steps per repeat, median of {args.repeats} alternating repeats\n"
    )
    rates = measure(contenders, args.steps, args.repeats)
    base = rates["trainkit steps_per_execution=1"]
    header = f"{'contender':40} {'steps/s':>9} {'vs trainkit k=1':>16}"
    print(header + "\n" + "-" * len(header))
    for name, rate in rates.items():
        print(f"{name:40} {rate:9.0f} {rate / base:16.2f}")
    fused = rates[f"trainkit steps_per_execution={k}"]
    keras_fused = rates.get(f"keras steps_per_execution={k}")
    print(f"\ntrainkit k={k} / trainkit k=1: {fused / base:.2f} (target >= 3)")
    if keras_fused is not None:
        print(f"trainkit k={k} / keras k={k}: {fused / keras_fused:.2f} (target >= 1)")
    scan = rates[f"hand-written scan, {k} steps per call"]
    print(f"trainkit k={k} / hand-written scan k={k}: {fused / scan:.2f}")
    on_device = rates[f"trainkit k={k}, data_on_device"]
    print(f"trainkit k={k} with data_on_device / hand-written scan k={k}: {on_device / scan:.2f}")


if __name__ == "__main__":
    main()
