"""Loss-spike skipping inside the step: a spiking batch's update is dropped exactly, the running
average resumes exactly, and a run of spikes stops training with the fix named."""

import logging

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import trainkit as tk

ROWS, BATCH = 128, 16  # 8 batches an epoch, in order
rng = np.random.default_rng(0)
X = rng.normal(size=(ROWS, 4)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5, 3.0], np.float32))[:, None]
SPIKE = 5  # the batch whose targets are corrupted
Y_SPIKED = Y.copy()
Y_SPIKED[SPIKE * BATCH : (SPIKE + 1) * BATCH] *= 1000.0


def trainer(strategy="single", skip=None):
    return tk.Trainer(
        nn.Dense(1),
        loss="mse",
        optimizer=optax.adam(1e-2),
        strategy=strategy,
        skip_spikes=skip or tk.SpikeSkip(factor=4.0, window=8, warmup=3),
    )


def params(fitted):
    return jax.tree.map(np.asarray, fitted.params)


def test_a_spiking_batch_is_skipped_as_if_it_were_not_there(caplog):
    skipping = trainer()
    with caplog.at_level(logging.WARNING, logger="trainkit"):
        skipping.fit(X, Y_SPIKED, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert f"the first at step {SPIKE + 1} (batch {SPIKE} of epoch 0)" in caplog.text, caplog.text
    assert int(skipping.state.spikes.skipped) == 1 and skipping.global_step == 8
    keep = np.r_[0 : SPIKE * BATCH, (SPIKE + 1) * BATCH : ROWS]
    without = trainer()
    without.fit(X[keep], Y_SPIKED[keep], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    jax.tree.map(np.testing.assert_array_equal, params(skipping), params(without))
    plain = tk.Trainer(nn.Dense(1), loss="mse", optimizer=optax.adam(1e-2), strategy="single")
    plain.fit(X, Y_SPIKED, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert np.abs(params(plain)["kernel"] - params(skipping)["kernel"]).max() > 1e-3  # the spike did move it there


def test_every_strategy_skips_the_same_update():
    single, parallel = trainer(), trainer(tk.DataParallel())
    for fitted in (single, parallel):
        fitted.fit(X, Y_SPIKED, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert int(parallel.state.spikes.skipped) == int(single.state.spikes.skipped) == 2
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params(parallel), params(single))


def test_a_resume_across_a_skip_is_bit_exact(tmp_path):
    whole = trainer()
    whole.fit(X, Y_SPIKED, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    first = trainer()
    first.fit(X, Y_SPIKED, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    first.save(tmp_path / "ck")
    resumed = trainer()
    resumed.init(X[:BATCH])
    resumed.load(tmp_path / "ck")
    assert int(resumed.state.spikes.seen) == 7 and int(resumed.state.spikes.skipped) == 1  # the average came back
    resumed.fit(X, Y_SPIKED, batch_size=BATCH, epochs=2, initial_epoch=1, shuffle=False, verbose=0)
    assert int(resumed.state.spikes.skipped) == 2
    jax.tree.map(np.testing.assert_array_equal, params(resumed), params(whole))


def test_a_checkpoint_without_the_average_is_refused_by_a_skipping_trainer(tmp_path):
    plain = tk.Trainer(nn.Dense(1), loss="mse", optimizer=optax.adam(1e-2), strategy="single")
    plain.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0)
    plain.save(tmp_path / "ck")
    skipping = trainer()
    skipping.init(X[:BATCH])
    with pytest.raises(tk.CheckpointError, match="skip_spikes"):
        skipping.load(tmp_path / "ck")


def test_a_run_of_spikes_stops_fit_naming_the_fix():
    y = Y.copy()
    y[4 * BATCH :] *= 1000.0  # from batch 4 on, every loss spikes
    stopping = trainer(skip=tk.SpikeSkip(factor=4.0, window=8, warmup=3, stop_after=3))
    with pytest.raises(
        RuntimeError, match=r"SpikeSkip: \d+ updates in a row, up to step 7, were skipped .*learning rate"
    ):
        stopping.fit(X, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert int(stopping.state.spikes.in_a_row) >= 3


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"factor": 1.0}, "it must be above 1"),
        ({"window": 0}, "positive number of steps"),
        ({"on": "accuracy"}, "watches 'loss' or 'grad_norm'"),
        ({"warmup": 0}, r"SpikeSkip\(warmup=0\): it must be a positive number of steps \(the first step's value"),
        ({"warmup": -2}, r"warmup=-2"),
        ({"warmup": 2.5}, r"warmup=2.5"),
        ({"warmup": True}, r"warmup=True"),
    ],
)
def test_bad_arguments_are_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        tk.SpikeSkip(**arguments)


def test_the_first_measured_value_is_never_a_spike():
    """Even a policy whose warm-up is left to the window (``window=1``: ``window // 10`` is 0)
    compares from the second step on: the first has no average to exceed. Every update is applied
    on a clean run (a spike skipped from the start would leave the weights at their initial values)."""
    skip = tk.SpikeSkip(factor=4.0, window=1)
    assert skip.first_decision == 1
    first, state = skip.decide(skip.initial(), jax.numpy.float32(123.0))
    assert not bool(first) and float(state.mean) == 123.0
    fitted = trainer(skip=skip)
    fitted.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert int(fitted.state.spikes.skipped) == 0 and fitted.global_step == 8


def test_skipped_updates_are_a_goodput_bucket_of_their_own_not_productive_time():
    skipping = tk.Trainer(
        nn.Dense(1), loss="mse", optimizer=optax.adam(1e-2), strategy="single", steps_per_execution=1,
        skip_spikes=tk.SpikeSkip(factor=4.0, window=8, warmup=3),
    )  # fmt: skip
    history = skipping.fit(X, Y_SPIKED, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert int(skipping.state.spikes.skipped) == 2
    buckets = history.goodput.buckets
    assert 0 < buckets["skipped"] < buckets["step"], buckets
