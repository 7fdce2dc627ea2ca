"""Gradient accumulation, clipping and schedules through optax, grad norm and learning rate in
the logs, and non-finite losses."""

import warnings

import jax
import numpy as np
import optax
import pytest
from conftest import MLP, NoisyMLP, make_classification, tree_allclose

import trainkit as tk


@pytest.mark.parametrize("strategy", ["single", "data_parallel", "fsdp", "hybrid"])
def test_accumulated_update_equals_the_whole_batch_update(strategy):
    if strategy == "hybrid":
        strategy = tk.Hybrid(data=2, fsdp=4, min_shard_size=16)
    x, y = make_classification(100)  # batch 32: the last batch holds 4 real rows
    params = {}
    for k in (1, 4):
        trainer = tk.Trainer(
            MLP(),
            loss="sparse_categorical_crossentropy",
            optimizer=optax.adam(0.01),
            metrics=["accuracy"],
            strategy=strategy,
            grad_accum_steps=k,
        )
        history = trainer.fit((x, y), batch_size=32, epochs=2, verbose=0)
        params[k] = (trainer.params, history.history)
    tree_allclose(params[4][0], params[1][0], rtol=1e-5, atol=1e-6)
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(params[4][1][name], params[1][1][name], rtol=1e-5)


def test_accumulation_with_batch_norm_is_the_same_under_every_strategy():
    """Micro-batches are the same rows under every jit strategy, so per-micro-batch batch
    statistics and dropout masks agree too."""
    x, y = make_classification(128)
    weights = {}
    for name, strategy in (
        ("single", "single"),
        ("fsdp", tk.FSDP(min_shard_size=16)),
        ("hybrid", tk.Hybrid(data=2, fsdp=4, min_shard_size=16)),
    ):
        trainer = tk.Trainer(
            NoisyMLP(),
            loss="sparse_categorical_crossentropy",
            optimizer=optax.sgd(0.05),
            strategy=strategy,
            grad_accum_steps=2,
        )
        trainer.fit((x, y), batch_size=32, epochs=2, shuffle=False, verbose=0)
        weights[name] = trainer.get_weights()
    tree_allclose(weights["fsdp"], weights["single"], rtol=1e-4, atol=1e-5)
    tree_allclose(weights["hybrid"], weights["single"], rtol=1e-4, atol=1e-5)


def test_accumulation_with_batch_norm_and_dropout_trains():
    x, y = make_classification(128)
    trainer = tk.Trainer(
        NoisyMLP(),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.adam(0.02),
        metrics=["accuracy"],
        strategy="dp",
        grad_accum_steps=2,
    )
    history = trainer.fit((x, y), batch_size=32, epochs=4, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_accumulation_needs_a_divisible_batch():
    x, y = make_classification(64)
    trainer = tk.Trainer(
        MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="dp", grad_accum_steps=3
    )
    with pytest.raises(
        ValueError,
        match=r"batch_size=32 cannot be split evenly across 8 devices x 3 "
        r"micro-batches \(grad_accum_steps\).*24 or 48",
    ):
        trainer.fit((x, y), batch_size=32, verbose=0)
    with pytest.raises(ValueError, match="grad_accum_steps must be a positive integer"):
        tk.Trainer(MLP(), loss="mse", optimizer=optax.sgd(0.1), grad_accum_steps=0, strategy="dp")


def test_clipping_schedule_learning_rate_and_grad_norm_in_the_logs():
    x, y = make_classification(64)
    schedule = optax.linear_schedule(0.1, 0.0, transition_steps=8)
    optimizer = optax.chain(optax.clip_by_global_norm(0.5), optax.inject_hyperparams(optax.sgd)(learning_rate=schedule))
    trainer = tk.Trainer(
        MLP(), loss="sparse_categorical_crossentropy", optimizer=optimizer, strategy="dp", log_grad_norm=True
    )
    trainer.init(x)
    start = trainer.get_weights()
    history = trainer.fit((x, y), batch_size=16, epochs=2, shuffle=False, verbose=0)
    # the learning rate of the last step of each epoch (steps 3 and 7, counted from 0)
    np.testing.assert_allclose(history.history["learning_rate"], [schedule(3), schedule(7)], rtol=1e-6)
    assert all(g > 0 for g in history.history["grad_norm"])
    # grad_norm is the unclipped global norm of the last step's gradient: recompute step 0's
    fresh = tk.Trainer(
        MLP(),
        loss="sparse_categorical_crossentropy",
        optimizer=optimizer,
        strategy="single",
        params=start,
        log_grad_norm=True,
    )
    first = fresh.fit((x[:16], y[:16]), batch_size=16, epochs=1, verbose=0).history["grad_norm"][0]

    def loss(params):
        logits = MLP().apply({"params": params}, x[:16])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y[:16]).mean()

    expected = float(optax.tree.norm(jax.grad(loss)(start["params"])))
    assert first == pytest.approx(expected, rel=1e-5)


def test_non_finite_loss_warns_with_the_step_unless_terminate_on_nan():
    x, y = make_classification(64)
    x = x.copy()
    x[40] = np.inf  # batch 2 (rows 32-47), i.e. step 3
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="dp")
    with pytest.warns(UserWarning, match=r"The loss is nan at step 3 \(batch 2 of epoch 0\).*TerminateOnNaN"):
        trainer.fit((x, y), batch_size=16, epochs=1, shuffle=False, verbose=0)
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="dp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(
            (x, y), batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[tk.callbacks.TerminateOnNaN()]
        )
    messages = [str(w.message) for w in caught]
    assert any("TerminateOnNaN: the loss became nan at batch 2 of epoch 0 (step 3" in m for m in messages)
    assert not any(m.startswith("The loss is") for m in messages)


def test_grad_norm_is_logged_only_when_asked():
    x, y = make_classification(32)
    for asked, keys in ((False, ["loss"]), (True, ["grad_norm", "loss"])):
        trainer = tk.Trainer(
            MLP(),
            loss="sparse_categorical_crossentropy",
            optimizer=optax.sgd(0.1),
            strategy="dp",
            **({"log_grad_norm": True} if asked else {}),
        )
        assert list(trainer.fit((x, y), batch_size=16, verbose=0).history) == keys
