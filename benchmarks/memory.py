"""Memory and speed per strategy: the compiled plan, and steps/s against hand-written steps.

For a 27.4M-parameter transformer LM and the 784-1024-1024-10 MLP (global batch 256) on 8
fake CPU devices:

1. the per-device argument / temporary / total bytes of the compiled train step under each
   strategy (``Trainer.plan``, measured: the table ``strategy="auto"`` chose from);
2. steps/s of ``Trainer.fit`` under SingleDevice, DataParallel, FSDP, both Hybrid shapes and
   ``"auto"``, relative to DataParallel, all measured side by side with alternating repeats;
3. each strategy against a hand-written loop with the same shardings (a ``jax.jit`` step with
   the trainer's own parameter / optimizer-state shardings; a ``pmap`` step for DataParallel).

    python benchmarks/memory.py [--repeats 5] [--case mlp|transformer|all]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(__file__))
from models import MLP, TransformerLM, count_params, token_batches  # noqa: E402
from step_overhead import measure  # noqa: E402

import trainkit as tk  # noqa: E402


def mlp_case(steps):
    rng = np.random.default_rng(0)
    n = 256 * steps
    x = rng.normal(size=(n, 784)).astype(np.float32)
    return MLP, x, rng.integers(0, 10, n).astype(np.int32), 256


def transformer_case(steps):
    x, y = token_batches(8192, 8, 64, steps)
    return TransformerLM, x, y, 8


CASES = {"mlp": (mlp_case, 20), "transformer": (transformer_case, 4)}


def strategies():
    return {
        "SingleDevice": lambda: tk.SingleDevice(),
        "DataParallel": lambda: tk.DataParallel(),
        "FSDP": lambda: tk.FSDP(),
        "Hybrid(data=2, fsdp=4)": lambda: tk.Hybrid(data=2, fsdp=4),
        "Hybrid(data=4, fsdp=2)": lambda: tk.Hybrid(data=4, fsdp=2),
    }


def make_trainer(model_cls, strategy):
    return tk.Trainer(
        model_cls(),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.adam(1e-3),
        strategy=strategy,
        log_grad_norm=False,
    )


def trainkit_run(trainer, x, y, batch_size):
    return lambda: trainer.fit((x, y), batch_size=batch_size, epochs=1, verbose=0)


def hand_written(trainer, x, y, batch_size):
    """A plain optax loop with the trainer's shardings: jit (or pmap for DataParallel), the state
    donated, 2 steps in flight."""
    model, tx, strategy = trainer.model, optax.adam(1e-3), trainer.strategy
    params = jax.device_get(trainer.state.params)

    def loss_fn(params, xb, yb):
        logits = model.apply({"params": params}, xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    def step(params, opt_state, xb, yb):
        loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
        if isinstance(strategy, tk.DataParallel):
            grads, loss = jax.lax.pmean((grads, loss), "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    shardings = jax.tree.map(lambda a: a.sharding, (trainer.state.params, trainer.state.opt_state))
    state = jax.device_put((params, tx.init(params)), shardings)
    if isinstance(strategy, tk.DataParallel):
        n = strategy.mesh.size
        compiled = jax.pmap(
            step,
            axis_name="data",
            in_axes=(None, None, 0, 0),
            out_axes=None,
            donate_argnums=(0, 1),
            devices=strategy.devices,
        )
        split = NamedSharding(strategy.mesh, P("data"))
        put = lambda a: jax.device_put(a.reshape(n, -1, *a.shape[1:]), split)  # noqa: E731
    else:
        batch = strategy.batch_sharding
        compiled = jax.jit(
            step,
            in_shardings=(*shardings, batch, batch),
            out_shardings=(*shardings, NamedSharding(strategy.mesh, P())),
            donate_argnums=(0, 1),
        )
        put = lambda a: jax.device_put(a, batch)  # noqa: E731
    box = {"state": state}

    def run():
        params, opt_state = box["state"]
        pending = []
        for lo in range(0, len(x), batch_size):
            params, opt_state, loss = compiled(
                params, opt_state, put(x[lo : lo + batch_size]), put(y[lo : lo + batch_size])
            )
            pending.append(loss)
            if len(pending) > 2:
                float(pending.pop(0))
        for loss in pending:
            float(loss)
        box["state"] = (params, opt_state)

    return run


def run_case(case, repeats):
    make_case, steps = CASES[case]
    model_cls, x, y, batch_size = make_case(steps)
    auto = make_trainer(model_cls, "auto")
    auto.fit((x[:batch_size], y[:batch_size]), batch_size=batch_size, epochs=1, verbose=0)  # plans
    params = count_params(auto.params)
    print(f"\n## {case}: {params / 1e6:.1f}M parameters, global batch {batch_size}, {steps} steps per repeat\n")
    auto.last_plan.print()
    trainers = {name: make_trainer(model_cls, make()) for name, make in strategies().items()}
    contenders = {}
    for name, trainer in trainers.items():
        trainer.init((x[:batch_size], y[:batch_size]))
        contenders[f"trainkit {name}"] = trainkit_run(trainer, x, y, batch_size)
        contenders[f"hand-written {name}"] = hand_written(trainer, x, y, batch_size)
    contenders["trainkit auto"] = trainkit_run(auto, x, y, batch_size)
    rate = measure(contenders, steps, repeats)  # steps/s, median of alternating repeats
    base = rate["trainkit DataParallel"]
    fastest = max(rate[f"trainkit {n}"] for n in trainers)
    print(f"\n{'strategy':24} {'steps/s':>8} {'vs DataParallel':>16} {'vs hand-written':>16}")
    for name in trainers:
        mine = rate[f"trainkit {name}"]
        print(f"{name:24} {mine:8.2f} {mine / base:16.3f} {mine / rate[f'hand-written {name}']:16.3f}")
    picked = tk.plan.short_name(auto.strategy)
    print(
        f"{'auto -> ' + picked:24} {rate['trainkit auto']:8.2f} {rate['trainkit auto'] / base:16.3f}"
        f"   auto / fastest strategy: {rate['trainkit auto'] / fastest:.3f}"
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--case", choices=[*CASES, "all"], default="all")
    args = parser.parse_args()
    print(
        f"jax {jax.__version__}, {len(jax.devices())} fake CPU devices, {os.cpu_count()} cores; "
        f"median of {args.repeats} alternating repeats"
    )
    for case in CASES if args.case == "all" else [args.case]:
        run_case(case, args.repeats)


if __name__ == "__main__":
    main()
