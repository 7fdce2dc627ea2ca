"""Loop overhead: steps/s of ``Trainer.fit`` against a hand-written jitted optax loop.

Same model, same batches (one shuffled epoch of NumPy batches), same devices, measured in one
run with alternating repeats; reported as ratios (trainkit / hand-written). On 8 fake CPU
devices DataParallel is compared with a hand-written ``pmap`` loop and a hand-written
``jit`` + ``NamedSharding`` loop. With the ``bench`` extra installed, Keras 3 ``fit`` on the
JAX backend (``keras.distribution.DataParallel`` on 8 devices) is a third column.
trainkit runs with its defaults (the same work as the hand-written loop); two more rows show
``log_grad_norm=True`` (one more pass over the gradients) and the cost of one batch-level
callback that is not ``async_safe`` (the loop then waits for every batch before dispatching the
next, so that ``on_train_batch_end(i)`` sees the state after batch ``i``, as in Keras), and one
the same work as a ``train_step`` of one's own (``state.mean``, ``state.apply_gradients``), whose
steps/s against the built-in step's is printed as a paired ratio.

The dispatch-bound rows (an MLP 32-64-10, batch 32, one device, where the host loop is the
cost) compare ``steps_per_execution=1`` (``verbose=0`` and the progress bar) with a
hand-written jit loop that keeps its loss total on the device, ``steps_per_execution=32``
with a hand-written ``lax.scan`` of 32 steps, and Keras 3's ``fit``; one more k=1 row runs the
step compiled with the state's small leaves unpacked (the A/B of ``core.leaf_step.Carry``).

    python benchmarks/step_overhead.py [--repeats 5] [--steps 60] [--dispatch-steps 2048] [--skip-models]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("KERAS_BACKEND", "jax")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import steps_per_execution as spe  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P
from rich.console import Console  # noqa: E402
from timing import measure_rounds, paired_ratio  # noqa: E402

import trainkit as tk  # noqa: E402
from trainkit.core import leaf_step  # noqa: E402


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(512)(x.reshape(x.shape[0], -1)))
        x = nn.relu(nn.Dense(512)(x))
        return nn.Dense(10)(x)


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.avg_pool(nn.relu(nn.Conv(32, (3, 3))(x)), (2, 2), strides=(2, 2))
        x = nn.avg_pool(nn.relu(nn.Conv(64, (3, 3))(x)), (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(256)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10)(x)


CASES = {"mlp": (MLP, (784,), 128), "cnn": (CNN, (28, 28, 1), 64)}


def dataset(shape, batch_size, steps, seed=0):
    rng = np.random.default_rng(seed)
    n = batch_size * steps
    return rng.normal(size=(n, *shape)).astype(np.float32), rng.integers(0, 10, n).astype(np.int32)


def epoch_batches(x, y, batch_size, epoch):
    order = np.random.default_rng([0, epoch]).permutation(len(x))
    for lo in range(0, len(x), batch_size):
        rows = order[lo : lo + batch_size]
        yield x[rows], y[rows]


def hand_written(model, x, y, batch_size, devices, kind):
    """A plain optax loop: the step jitted (or pmapped), the state donated, 2 steps in flight."""
    tx = optax.adam(1e-3)
    params = model.init(jax.random.PRNGKey(0), x[:1])["params"]

    def loss_fn(params, xb, yb):
        logits = model.apply({"params": params}, xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    if kind == "pmap":

        def step(params, opt_state, xb, yb):
            loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
            grads, loss = jax.lax.pmean((grads, loss), "data")
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        mesh = tk.strategies.make_mesh(devices, (len(devices),), ("data",))
        state = jax.device_put((params, tx.init(params)), NamedSharding(mesh, P()))
        compiled = jax.pmap(
            step, axis_name="data", in_axes=(None, None, 0, 0), out_axes=None, donate_argnums=(0, 1), devices=devices
        )
        n = len(devices)
        put = lambda a: jax.device_put(a.reshape(n, -1, *a.shape[1:]), NamedSharding(mesh, P("data")))  # noqa: E731
    else:

        def step(params, opt_state, xb, yb):
            loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        mesh = tk.strategies.make_mesh(devices, (len(devices),), ("data",))
        rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        state = jax.device_put((params, tx.init(params)), rep)
        compiled = jax.jit(
            step, in_shardings=(rep, rep, split, split), out_shardings=(rep, rep, rep), donate_argnums=(0, 1)
        )
        put = lambda a: jax.device_put(a, split)  # noqa: E731

    box = {"state": state, "epoch": 0}

    def run():
        params, opt_state = box["state"]
        pending = []
        for xb, yb in epoch_batches(x, y, batch_size, box["epoch"]):
            params, opt_state, loss = compiled(params, opt_state, put(xb), put(yb))
            pending.append(loss)
            if len(pending) > 2:
                float(pending.pop(0))
        for loss in pending:
            float(loss)
        box["state"], box["epoch"] = (params, opt_state), box["epoch"] + 1

    return run


class ReadsLoss(tk.callbacks.Callback):
    """A Keras-style batch callback (not ``async_safe``): it reads each batch's running loss."""

    def on_train_batch_end(self, batch, logs=None):
        self.loss = logs["loss"]


class OwnStep(tk.Trainer):
    """The built-in step's work written as a ``train_step`` of one's own (#58): the cross-entropy's
    masked mean over the global batch, its gradient, the optimizer's update."""

    def train_step(self, state, batch, rng):
        def loss_fn(params):
            logits, _ = state.apply(params, state.model_state, batch["x"], rng=rng, train=True)
            return state.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), batch)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads), {"loss": loss}


def trainkit_fit(model, x, y, batch_size, strategy, log_grad_norm=False, callbacks=(), trainer_class=tk.Trainer):
    trainer = trainer_class(
        model,
        loss="sparse_categorical_crossentropy",
        optimizer=optax.adam(1e-3),
        strategy=strategy,
        log_grad_norm=log_grad_norm,
    )
    return lambda: trainer.fit((x, y), batch_size=batch_size, epochs=1, verbose=0, callbacks=list(callbacks))


def keras_fit(case, x, y, batch_size, devices):
    try:
        import keras
    except ImportError:
        return None
    if len(devices) > 1:
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    else:
        keras.distribution.set_distribution(None)
    layers = keras.layers
    if case == "mlp":
        body = [layers.Flatten(), layers.Dense(512, activation="relu"), layers.Dense(512, activation="relu")]
    else:
        body = [
            layers.Conv2D(32, 3, padding="same", activation="relu"),
            layers.AveragePooling2D(2),
            layers.Conv2D(64, 3, padding="same", activation="relu"),
            layers.AveragePooling2D(2),
            layers.Flatten(),
            layers.Dense(256, activation="relu"),
        ]
    model = keras.Sequential([keras.Input(x.shape[1:]), *body, layers.Dense(10)])
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    # Keras waits for the device only at epoch ends; 60 queued all-reduces deadlock XLA's CPU
    # collectives on 8 fake devices, so its epoch is cut into chunks of 10 steps.
    steps = len(x) // batch_size
    chunk = 10 if len(devices) > 1 and steps % 10 == 0 else steps
    return lambda: model.fit(
        x, y, batch_size=batch_size, epochs=steps // chunk, steps_per_epoch=chunk, verbose=0, shuffle=True
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--dispatch-steps", type=int, default=2048, help="steps of the dispatch-bound rows (0: none)")
    parser.add_argument("--skip-models", action="store_true", help="only the dispatch-bound rows")
    args = parser.parse_args()
    devices = jax.devices()
    print(
        f"jax {jax.__version__}, {len(devices)} fake CPU devices, {os.cpu_count()} cores; "
        f"{args.steps} steps per repeat, median of {args.repeats} alternating repeats\n"
    )
    header = f"{'model':5} {'devices':>7} {'contender':28} {'steps/s':>9} {'vs hand-written':>16}"
    print(header + "\n" + "-" * len(header))
    for case, (model_cls, shape, batch_size) in ({} if args.skip_models else CASES).items():
        x, y = dataset(shape, batch_size, args.steps)
        for n in (1, 8):
            devs = devices[:n]
            contenders = {"hand-written jit": hand_written(model_cls(), x, y, batch_size, devs, "jit")}
            if n > 1:
                contenders["hand-written pmap"] = hand_written(model_cls(), x, y, batch_size, devs, "pmap")
            strategy = tk.SingleDevice(devs[0]) if n == 1 else tk.DataParallel(devs)
            contenders[f"trainkit {type(strategy).__name__}"] = trainkit_fit(model_cls(), x, y, batch_size, strategy)
            contenders["  + log_grad_norm=True"] = trainkit_fit(model_cls(), x, y, batch_size, strategy, True)
            contenders["  + a batch callback (sync)"] = trainkit_fit(
                model_cls(), x, y, batch_size, strategy, callbacks=[ReadsLoss()]
            )
            contenders["  a train_step of your own"] = trainkit_fit(
                model_cls(), x, y, batch_size, strategy, trainer_class=OwnStep
            )
            keras_run = keras_fit(case, x, y, batch_size, devs)
            if keras_run is not None:
                contenders["keras fit"] = keras_run
            rounds = measure_rounds(contenders, args.steps, args.repeats)
            rates = {name: statistics.median(r) for name, r in rounds.items()}
            base = rates["hand-written pmap" if n > 1 else "hand-written jit"]
            for name, rate in rates.items():
                print(f"{case:5} {n:>7} {name:28} {rate:9.1f} {rate / base:16.3f}")
            own = paired_ratio(rounds, "  a train_step of your own", f"trainkit {type(strategy).__name__}")
            print(f"{case:5} {n:>7} {'train_step / built-in step':28} {'':9} {own:16.3f} (paired)")
    print("\nratios are against the hand-written pmap loop on 8 devices, the jit loop on 1.")
    if args.dispatch_steps:
        dispatch_bound(args.dispatch_steps, args.repeats)


def quiet_bar() -> tk.callbacks.ProgressBar:
    """``verbose=1``'s progress bar, drawn into a terminal-like buffer instead of the screen."""
    return tk.callbacks.ProgressBar(verbose=1, console=Console(file=io.StringIO(), force_terminal=True, width=120))


def dispatch_bound(steps: int, repeats: int, k: int = 32) -> None:
    """A model whose step is shorter than a Python dispatch (MLP 32-64-10, batch 32, one
    device): the host loop is the cost. Against a hand-written jit loop that keeps its loss
    total on the device, and a hand-written ``lax.scan`` of ``k`` steps per call."""
    x, y = spe.dataset(steps)
    contenders = {
        "hand-written jit": spe.hand_written(x, y, 1),
        "trainkit k=1, verbose=0": spe.trainkit_fit(x, y, 1),
        "trainkit k=1, verbose=1": spe.trainkit_fit(x, y, 1, callbacks=[quiet_bar()]),
        "trainkit k=1, unpacked": unpacked_fit(x, y),
        f"hand-written scan k={k}": spe.hand_written(x, y, k),
        f"trainkit k={k}": spe.trainkit_fit(x, y, k),
        "trainkit k='auto'": spe.trainkit_fit(x, y, "auto"),
        "trainkit default k": spe.trainkit_fit(x, y, None),
    }
    keras_run = spe.keras_fit(x, y, 1)
    if keras_run is not None:
        contenders["keras fit k=1"] = keras_run
    rounds = measure_rounds(contenders, steps, repeats)
    rates = {name: statistics.median(r) for name, r in rounds.items()}
    print(f"\ndispatch-bound MLP {spe.FEATURES}-{spe.HIDDEN}-{spe.CLASSES}, batch {spe.BATCH}, 1 device, {steps} steps")
    header = f"{'contender':28} {'steps/s':>9} {'vs hand-written':>16} {'paired':>7}"
    print(header + "\n" + "-" * len(header))
    for name, rate in rates.items():
        base = (
            f"hand-written scan k={k}"
            if f"k={k}" in name or "auto" in name or "default" in name
            else "hand-written jit"
        )
        paired = paired_ratio(rounds, name, base)
        print(f"{name:28} {rate:9.0f} {rate / rates[base]:16.3f} {paired:7.3f}")
    print(f"(k={k}, k='auto' and default rows against the hand-written scan, the others against the jit loop;")
    print(" 'paired': the median of each round's ratio, the runs compared seconds apart)")
    auto, fixed = rates["trainkit k='auto'"], rates[f"trainkit k={k}"]
    print(f"k='auto' / trainkit k={k}: {auto / fixed:.3f}")
    packed = paired_ratio(rounds, "trainkit k=1, verbose=0", "trainkit k=1, unpacked")
    print(f"k=1 with the small leaves packed / unpacked (paired): {packed:.3f}")
    long_fits(16 * steps, repeats, k)
    first_fits((steps, 16 * steps))


def long_fits(steps: int, repeats: int, k: int) -> None:
    """The default setting where fusing pays: fits of ``steps`` steps, steady state (after a
    warm-up fit), against the hand-written scan on the same data."""
    x, y = spe.dataset(steps)
    contenders = {
        f"hand-written scan k={k}": spe.hand_written(x, y, k),
        "trainkit default k": spe.trainkit_fit(x, y, None),
    }
    rounds = measure_rounds(contenders, steps, repeats)
    rates = {name: statistics.median(r) for name, r in rounds.items()}
    paired = paired_ratio(rounds, "trainkit default k", f"hand-written scan k={k}")
    print(f"\nfits of {steps} steps: trainkit default k {rates['trainkit default k']:.0f} steps/s, ", end="")
    print(f"{rates['trainkit default k'] / rates[f'hand-written scan k={k}']:.3f} of the scan (paired {paired:.3f})")


def first_fits(lengths: tuple[int, ...]) -> None:
    """What one fit costs a user end to end, compiles included (fresh trainers, the persistent
    compilation cache off): k=1, the default and ``"auto"``, at each length. The default fuses
    only where the fit repays the fused program's compile; ``"auto"`` always fuses."""
    import time

    from trainkit.distributed import compile_cache

    saved = os.environ.get(compile_cache.ENVIRONMENT)
    os.environ[compile_cache.ENVIRONMENT] = "off"
    try:
        print("\none fit, end to end (compiles included; fresh trainers; the compilation cache off):")
        print(f"{'steps':>7} {'k=1 s':>8} {'default s':>10} {'(its k)':>8} {'auto s':>8} {'(its k)':>8}")
        for length in lengths:
            x, y = spe.dataset(length)
            seconds, picked = {}, {}
            for k in (1, None, "auto"):
                trainer = spe.make_trainer(k)
                start = time.perf_counter()
                trainer.fit((x, y), batch_size=spe.BATCH, epochs=1, verbose=0)
                seconds[k], picked[k] = time.perf_counter() - start, trainer.steps_per_execution
            print(
                f"{length:>7} {seconds[1]:8.2f} {seconds[None]:10.2f} {picked[None]:>8} "
                f"{seconds['auto']:8.2f} {picked['auto']:>8}"
            )
    finally:
        if saved is None:
            os.environ.pop(compile_cache.ENVIRONMENT)
        else:
            os.environ[compile_cache.ENVIRONMENT] = saved


def unpacked_fit(x: np.ndarray, y: np.ndarray):
    """``trainkit_fit`` at k=1 with its step compiled before the small state leaves were packed
    into one array (``trainkit.core.leaf_step.Carry``): the A/B of that change, in one run."""
    run = spe.trainkit_fit(x, y, 1)
    packing, leaf_step.SMALL_LEAF = leaf_step.SMALL_LEAF, 0
    try:
        run()  # compiles (the trainer keeps the compiled step for its later fits)
    finally:
        leaf_step.SMALL_LEAF = packing
    return run


if __name__ == "__main__":
    main()
