"""Inputs that used to train on the wrong thing without a word, or fail with a framework error,
now get a clear error before compiling (or, for the shapes Keras accepts, the right result)."""

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import trainkit as tk

N = 40


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 4)).astype("float32"), rng.integers(0, 3, N).astype("int32")


def classifier(**kwargs):
    kwargs.setdefault("loss", "sparse_categorical_crossentropy")
    kwargs.setdefault("strategy", "single")
    return tk.Trainer(nn.Dense(3), optimizer=optax.sgd(0.1), **kwargs)


def test_sample_weights_of_shape_n_by_1_equal_n_and_others_are_refused(data):
    x, y = data
    weights = np.linspace(0.5, 1.5, N).astype("float32")
    flat = classifier().fit(x, y, sample_weight=weights, batch_size=8, shuffle=False, verbose=0).history["loss"]
    column = classifier().fit(x, y, sample_weight=weights[:, None], batch_size=8, shuffle=False, verbose=0)
    np.testing.assert_allclose(column.history["loss"], flat, rtol=1e-6)  # not broadcast to (B, B)
    with pytest.raises(ValueError, match=r"sample_weight is per token, shape \(\d+, 2\).*does not lead with it"):
        classifier().fit(x, y, sample_weight=np.ones((N, 2)), verbose=0)  # (N, 2) for (N,) labels: not per token
    with pytest.raises(ValueError, match=r"sample_weight\[3\] is -1.0: sample weights must be finite and non-negative"):
        classifier().fit(x, y, sample_weight=np.where(np.arange(N) == 3, -1.0, 1.0), verbose=0)
    with pytest.raises(ValueError, match=r"sample_weight\[0\] is nan"):
        classifier().fit(x, y, sample_weight=np.full(N, np.nan), verbose=0)
    with pytest.raises(ValueError, match=r"one array with a weight per row \(or per token\), applied to every output"):
        classifier().fit(x, y, sample_weight={"a": np.ones(N)}, verbose=0)
    batches = [(x[:8], y[:8], np.ones(8)), (x[8:16], y[8:16], -np.ones(8))]
    with pytest.raises(ValueError, match=r"sample_weight of batch 1\[0\] is -1.0"):
        classifier().fit(batches, verbose=0)


@pytest.mark.parametrize("bad", [-1, 3])
def test_sparse_labels_outside_the_classes_are_named(data, bad):
    x, y = data
    y = y.copy()
    y[7] = bad
    with pytest.raises(ValueError, match=rf"y holds label {bad} \(row 7\), but the model outputs 3 classes"):
        classifier().fit(x, y, verbose=0)
    with pytest.raises(ValueError, match=rf"label {bad} \(row 7\)"):
        classifier().fit(x, data[1], validation_data=(x, y), verbose=0)


@pytest.mark.parametrize("strategy, bad", [("single", -1), ("dp", 7), ("fsdp", -1)])
def test_a_later_batch_of_an_iterable_with_labels_outside_the_classes_stops_the_run(data, bad, strategy):
    x, y = data
    batches = [(x[i : i + 8], y[i : i + 8].copy()) for i in range(0, 32, 8)]
    batches[2][1][5] = bad  # the first batch, which the host checks, is fine
    trainer = classifier(strategy=strategy)
    with pytest.raises(
        ValueError, match=rf"Batch 2 of epoch 0 \(step 3\) holds 1 label\(s\) .*example {bad}; .* 3 classes"
    ):
        trainer.fit((b for b in batches), steps_per_epoch=4, verbose=0)
    good = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]
    assert "_labels_out_of_range" not in classifier(strategy=strategy).fit(good, verbose=0).history  # not logged


@pytest.mark.parametrize("dtype", ["int32", "bool"])
def test_one_hot_labels_for_a_sparse_loss_are_named_one_hot(data, dtype):
    x, y = data
    one_hot = np.eye(3, dtype=dtype)[y]
    trainer = classifier()
    with pytest.raises(
        ValueError, match=r"The labels y look one-hot \(per-example shape \(3,\).*categorical_crossentropy.*argmax"
    ):
        trainer.fit(x, one_hot, verbose=0)
    sequences = tk.Trainer(
        nn.Dense(3), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single"
    )
    tokens = np.eye(4, dtype="int32")[np.arange(N) % 4]  # (N, 4) class ids of 4 positions: not one-hot here
    sequences.fit(np.repeat(x[:, None, :], 4, axis=1), tokens, epochs=1, verbose=0)
    classifier(loss="categorical_crossentropy").fit(x, one_hot.astype("float32"), epochs=1, verbose=0)  # the fix


def test_targets_the_loss_cannot_compare_are_refused(data):
    x, y = data
    with pytest.raises(
        ValueError, match=r"The targets y have per-example shape \(2,\), but the model outputs \(3,\); the loss 'mse'"
    ):
        classifier(loss="mse").fit(x, np.ones((N, 2), "float32"), verbose=0)
    with pytest.raises(ValueError, match="needs integer class ids"):
        classifier().fit(x, y, validation_data=(x, np.eye(3, dtype="float32")[y]), verbose=0)
    with pytest.raises(ValueError, match="Integer class ids need loss='sparse_categorical_crossentropy'"):
        classifier(loss="categorical_crossentropy").fit(x, y, verbose=0)
    labels = classifier().fit(x, y[:, None], verbose=0).history["loss"]  # (N, 1) labels are fine, as in Keras
    assert np.isfinite(labels).all()


def test_non_numeric_inputs_are_refused(data):
    _, y = data
    with pytest.raises(ValueError, match=r"x has dtype <U1 \(strings\); models take numbers"):
        classifier().fit(np.array(["a"] * N), y, verbose=0)
    with pytest.raises(ValueError, match=r"x\['text'\] has dtype object \(Python objects\)"):
        classifier().fit({"text": np.array([None] * N)}, y, verbose=0)


def test_bad_counts_are_refused(data):
    x, y = data
    with pytest.raises(ValueError, match="batch_size=True: it must be a positive integer"):
        classifier().fit(x, y, batch_size=True, verbose=0)
    with pytest.raises(ValueError, match="steps must be a positive integer or None; received steps=0"):
        classifier().evaluate(x, y, steps=0)
    with pytest.raises(ValueError, match="steps must be a positive integer or None; received steps=0"):
        classifier().predict(x, steps=0)


class TwiceTheRows(tk.Trainer):
    def compute_loss(self, params, batch, rng, *, model_state, train):
        out, model_state = self.apply(params, model_state, batch["x"], rng=rng, train=train)
        return jnp.concatenate([out[:, 0], out[:, 1]]), (out, model_state)


class IntegerLoss(tk.Trainer):
    def compute_loss(self, params, batch, rng, *, model_state, train):
        out, model_state = self.apply(params, model_state, batch["x"], rng=rng, train=train)
        return (out[:, 0] > 0).astype(jnp.int32), (out, model_state)


def test_a_custom_loss_must_give_one_float_per_row(data):
    x, y = data
    with pytest.raises(ValueError, match=r"The loss has shape \(64,\) for a batch of 32 rows"):
        TwiceTheRows(nn.Dense(3), optimizer=optax.sgd(0.1), strategy="single").fit(x, y, verbose=0)
    with pytest.raises(ValueError, match="The loss has dtype int32: it must be floating"):
        IntegerLoss(nn.Dense(3), optimizer=optax.sgd(0.1), strategy="single").fit(x, y, verbose=0)


def test_validation_iterables_keep_their_batch_size_and_one_shot_ones_serve_one_run(data):
    x, y = data

    def batches_of_8():
        for i in range(0, N, 8):
            yield x[i : i + 8], y[i : i + 8]

    trainer = classifier()
    history = trainer.fit(x, y, batch_size=16, validation_data=batches_of_8(), verbose=0).history
    assert history["val_loss"][0] == pytest.approx(trainer.evaluate(x, y, batch_size=16), rel=1e-5)
    with pytest.raises(ValueError, match="validation_data is a one-shot iterator .* but 2 epochs validate"):
        classifier().fit(x, y, epochs=2, validation_data=batches_of_8(), verbose=0)
    history = classifier().fit(x, y, epochs=2, validation_data=batches_of_8(), validation_steps=2, verbose=0)
    assert len(history.history["val_loss"]) == 2  # each validation reads the next 2 batches


def test_device_arrays_stay_on_their_device_and_train_as_host_arrays(data):
    """A ``jax.Array`` given to fit is sliced where it lives, one batch at a time to the host
    (no full host copy), and trains exactly as the same NumPy arrays."""
    import jax

    from trainkit.data import ArrayDataset, split_validation

    x, y = data
    on_device = ArrayDataset(jax.numpy.asarray(x), jax.numpy.asarray(y))
    assert all(isinstance(leaf, jax.Array) for leaf in (on_device.x, on_device.y))
    train, val = split_validation(on_device, 0.25)
    assert isinstance(train.x, jax.Array) and isinstance(val.x, jax.Array)
    histories = [
        classifier().fit(inputs, labels, batch_size=8, epochs=2, validation_split=0.25, verbose=0).history
        for inputs, labels in ((x, y), (jax.numpy.asarray(x), jax.numpy.asarray(y)))
    ]
    for key in histories[0]:
        np.testing.assert_allclose(histories[1][key], histories[0][key], rtol=1e-6, err_msg=key)


class ConvOverRows(nn.Module):
    """A Conv and a pooling: given (N, H, W) without the channel axis, Flax convolves over N."""

    @nn.compact
    def __call__(self, x):
        x = nn.avg_pool(nn.relu(nn.Conv(4, (3, 3))(x)), (2, 2), strides=(2, 2))
        return nn.Dense(3)(x.reshape(x.shape[0], -1))


class NeedsImages(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x.reshape(x.shape[0], 8, 8, 1).mean(axis=(1, 2)))


def test_a_model_that_loses_the_batch_axis_or_fails_on_the_inputs_is_named_with_them():
    rng = np.random.default_rng(0)
    images, labels = rng.normal(size=(32, 8, 8)).astype("float32"), rng.integers(0, 3, 32).astype("int32")
    trainer = tk.Trainer(ConvOverRows(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1))
    with pytest.raises(
        ValueError,
        match=r"outputs of shape \(8, 3\) for a batch of 16 rows \(inputs float32\[16, 8, 8\]\).*x\[\.\.\., None\]",
    ):
        trainer.fit(images, labels, batch_size=16, verbose=0)
    assert trainer.state is None  # refused before anything was built
    tk.Trainer(ConvOverRows(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1)).fit(
        images[..., None], labels, batch_size=16, epochs=1, verbose=0
    )  # the fix
    failing = tk.Trainer(NeedsImages(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1))
    with pytest.raises(
        ValueError, match=r"raised TypeError when called on the first batch, whose inputs are float32\[16, 5\]"
    ) as raised:
        failing.fit(rng.normal(size=(32, 5)).astype("float32"), labels, batch_size=16, verbose=0)
    assert isinstance(raised.value.__cause__, TypeError)  # the model's own error, kept as the cause
