"""Data forms: arrays, Keras-style x and y, iterables and generators; one rule for dicts."""

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, make_classification, tree_allclose

import trainkit as tk
from trainkit.data import ArrayDataset, BatchRequest, as_dataset


def test_every_row_appears_exactly_once_per_epoch_with_a_padded_last_batch():
    x = np.arange(37, dtype=np.float32)[:, None]
    dataset = ArrayDataset(x, np.arange(37))
    batches = list(dataset.batches(8, BatchRequest(shuffle=True, seed=1, epoch=0)))
    assert len(batches) == 5 and all(b["x"].shape == (8, 1) for b in batches)
    real = np.concatenate([b["y"][b["mask"] > 0] for b in batches])
    assert sorted(real.tolist()) == list(range(37))
    assert batches[-1]["mask"].tolist() == [1.0] * 5 + [0.0] * 3
    other_epoch = np.concatenate([b["y"] for b in dataset.batches(8, BatchRequest(shuffle=True, seed=1, epoch=1))])
    assert not np.array_equal(real, other_epoch[:37])  # a new order every epoch
    resumed = list(dataset.batches(8, BatchRequest(shuffle=True, seed=1, epoch=0, start=3)))
    np.testing.assert_array_equal(resumed[0]["y"], batches[3]["y"])


def test_forms_of_the_same_data_train_identically():
    x, y = make_classification(40)
    forms = {
        "tuple": dict(data=(x, y)),
        "keras": dict(data=x, y=y),
        "with_weights": dict(data=(x, y, np.ones(40, np.float32))),
        "list_of_batches": dict(data=[(x[i : i + 16], y[i : i + 16]) for i in range(0, 40, 16)]),
        "generator": dict(data=((x[i : i + 16], y[i : i + 16]) for i in range(0, 40, 16)), steps_per_epoch=3),
    }
    params = {}
    for name, kwargs in forms.items():
        trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="dp")
        batch_size = None if name in ("list_of_batches", "generator") else 16
        data = kwargs.pop("data")
        trainer.fit(data, **kwargs, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
        params[name] = trainer.params
        assert int(trainer.state.step) == 3
    for name in forms:
        tree_allclose(params[name], params["tuple"])


class TwoInputs(nn.Module):
    """A model whose inputs are named "x" and "y" (the names the old dataset-dict form took)."""

    @nn.compact
    def __call__(self, inputs, train: bool = False):
        return nn.Dense(3)(jnp.concatenate([inputs["x"], inputs["y"]], axis=-1))


def test_a_dict_is_the_models_inputs_whatever_its_keys():
    x, labels = make_classification(32)
    inputs = {"x": x, "y": x[:, ::-1]}
    trainer = tk.Trainer(TwoInputs(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1))
    trainer.fit(inputs, labels, batch_size=16, epochs=1, verbose=0)  # Keras's rule: the dict is x
    assert trainer.predict(inputs, batch_size=16).shape == (32, 3)
    trainer.fit([(inputs, labels)], epochs=1, verbose=0)  # a dict inside a batch tuple is x too
    mlp = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"no targets.*read as two inputs named 'x' and 'y'; pass .* tuple \(x, y\)"):
        mlp.fit({"x": x, "y": labels}, epochs=1, verbose=0)


def test_generator_is_consumed_across_epochs_with_steps_per_epoch():
    x, y = make_classification(64)

    def forever():
        while True:
            for i in range(0, 64, 8):
                yield x[i : i + 8], y[i : i + 8]

    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="dp")
    history = trainer.fit(forever(), epochs=3, steps_per_epoch=5, verbose=0)
    assert len(history.epoch) == 3 and int(trainer.state.step) == 15
    with pytest.raises(ValueError, match="one-shot iterator.*steps_per_epoch"):
        trainer.fit(iter([(x, y)]), epochs=2, verbose=0)


def test_max_steps_bounds_the_run():
    x, y = make_classification(64)
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="dp")
    history = trainer.fit((x, y), epochs=10, batch_size=16, max_steps=6, verbose=0)
    assert int(trainer.state.step) == 6 and history.epoch == [0, 1]


def test_iterable_batch_larger_than_the_first_is_rejected():
    x, y = make_classification(40)
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="dp")
    with pytest.raises(ValueError, match="A batch of 24 rows follows a first batch of 16 rows"):
        trainer.fit([(x[:16], y[:16]), (x[16:], y[16:])], verbose=0)


def test_predict_accepts_iterables_and_drops_padding():
    x, _ = make_classification(21)
    trainer = tk.Trainer(MLP(), loss="mse", optimizer=optax.sgd(0.1), strategy="dp")
    direct = trainer.predict(x, batch_size=8)
    batched = trainer.predict(iter([x[i : i + 8] for i in range(0, 21, 8)]))
    assert direct.shape == batched.shape == (21, 3)
    np.testing.assert_allclose(direct, batched, rtol=1e-6)
    # Keras predicts a generator of uneven batches: a batch larger than the first is split
    uneven = trainer.predict((x[lo:hi] for lo, hi in [(0, 8), (8, 21)]))
    np.testing.assert_allclose(direct, uneven, rtol=1e-6)


def test_unsupported_data_type():
    with pytest.raises(TypeError, match="Cannot train on data of type int"):
        as_dataset(3)


def test_a_long_epoch_on_8_devices_never_queues_without_bound():
    """Hundreds of steps in one epoch: with an unbounded queue XLA's CPU all-reduce deadlocks."""
    x, y = make_classification(2400)
    trainer = tk.Trainer(
        MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.05), metrics=["accuracy"], strategy="dp"
    )
    history = trainer.fit((x, y), epochs=1, batch_size=8, verbose=0)
    assert int(trainer.state.step) == 300 and history.history["accuracy"][0] > 0.6


def test_validation_every_n_steps_for_step_based_training():
    x, y = make_classification(64)
    x_val, y_val = make_classification(24, seed=1)

    def stream():
        while True:
            for i in range(0, 64, 8):
                yield x[i : i + 8], y[i : i + 8]

    def trainer():  # one explicit strategy: "auto" may time another one faster in the reference run
        return tk.Trainer(
            MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), seed=4, strategy="single"
        )

    run = trainer()
    history = run.fit(
        stream(),
        epochs=1,
        steps_per_epoch=1000,
        max_steps=12,
        validation_data=(x_val, y_val),
        validation_interval=5,
        verbose=0,
    )
    assert [v["step"] for v in history.validations] == [5, 10] and int(run.state.step) == 12
    assert history.history["val_loss"] == [history.validations[-1]["val_loss"]]  # the epoch logs carry the latest
    reference = trainer()
    reference.fit(stream(), epochs=1, steps_per_epoch=5, verbose=0)  # the state after step 5
    assert reference.evaluate(x_val, y_val, batch_size=8) == pytest.approx(history.validations[0]["val_loss"], abs=0)
    with pytest.raises(ValueError, match="validation_interval=5 needs validation_data"):
        trainer().fit(stream(), epochs=1, steps_per_epoch=3, validation_interval=5, verbose=0)
