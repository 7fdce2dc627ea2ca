"""Per-token ``sample_weight`` (issue #83): a ``(rows, T)`` weight for a ``(rows, T, classes)`` output weighs
each token's loss as Keras 3 does (``sum_over_batch_size``: the weighted tokens' sum over their count),
checked side by side with Keras (JAX backend) from the same weights, SGD, no shuffling, a ragged last batch,
on one device and on 8; and what would drop such weights without a word is refused by name."""

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import trainkit as tk

keras = pytest.importorskip("keras")

N, T, F, C, BATCH = 100, 6, 4, 5, 32


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N, T, F)).astype("float32")
    y = rng.integers(0, C, size=(N, T)).astype("int32")
    w = (rng.uniform(0.0, 2.0, size=(N, T)) * (rng.uniform(size=(N, T)) > 0.3)).astype("float32")  # padding tokens 0
    return x, y, w


def twins(strategy, **extra):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((T, F)), keras.layers.Dense(C)])
    model.compile(
        optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    kernel, bias = model.get_weights()
    trainer = tk.Trainer(
        nn.Dense(C),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.sgd(0.5),
        strategy=strategy,
        params={"kernel": kernel, "bias": bias},
        **extra,
    )
    return model, trainer


@pytest.mark.parametrize("strategy", ["single", "dp", "fsdp"])
def test_per_token_weights_train_and_evaluate_as_keras(data, strategy):
    x, y, w = data
    model, trainer = twins(strategy)
    fit = {"sample_weight": w, "epochs": 2, "batch_size": BATCH, "shuffle": False, "verbose": 0}
    theirs, ours = model.fit(x, y, **fit).history, trainer.fit(x, y, **fit).history
    np.testing.assert_allclose(ours["loss"], theirs["loss"], rtol=1e-5, atol=1e-6)
    kernel, bias = model.get_weights()
    np.testing.assert_allclose(trainer.params["kernel"], kernel, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trainer.params["bias"], bias, rtol=1e-5, atol=1e-6)
    evaluated = model.evaluate(x, y, sample_weight=w, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(trainer.evaluate(x, y, sample_weight=w, batch_size=BATCH), evaluated, rtol=1e-5)
    unweighted = trainer.evaluate(x, y, batch_size=BATCH)
    assert abs(unweighted - evaluated) > 1e-3  # the weights changed the figure: they were not dropped


def test_what_would_drop_per_token_weights_is_refused_by_name(data):
    x, y, w = data
    _, trainer = twins("single", weighted_metrics=["accuracy"])
    with pytest.raises(ValueError, match=r"weighted_metrics \['accuracy'\] weigh rows.*per token"):
        trainer.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=1, verbose=0)

    class PerRow(tk.Trainer):  # a loss of one value per row cannot take a weight per token
        def compute_loss(self, params, batch, rng, *, model_state, train):
            logits, model_state = self.apply(params, model_state, batch["x"], rng=rng, train=train)
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
            return losses.mean(axis=1), (logits, model_state)

    per_row = PerRow(nn.Dense(C), optimizer=optax.sgd(0.5), strategy="single")
    with pytest.raises(ValueError, match=r"shape \(32,\) and sample_weight, per token, \(32, 6\)"):
        per_row.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=1, verbose=0)

    class OwnStep(tk.Trainer):
        def train_step(self, state, batch, rng):
            logits, _ = state.apply(state.params, state.model_state, batch["x"], rng=rng, train=True)
            return state, {"loss": state.mean(jnp.mean(logits, axis=(1, 2)), batch)}

    own = OwnStep(nn.Dense(C), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.5), strategy="single")
    with pytest.raises(ValueError, match=r"state.mean weighs rows, and this batch's sample_weight is per token"):
        own.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=1, verbose=0)
    negative = w.copy()
    negative[3, 2] = -1.0
    with pytest.raises(ValueError, match=r"sample_weight\[3, 2\] is -1.0: sample weights must be finite"):
        trainer.fit(x, y, sample_weight=negative, batch_size=BATCH, epochs=1, verbose=0)


@pytest.fixture(scope="module")
def padded():
    """Sequences of 2 to 6 tokens padded with class 0 (the class the loss ignores)."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(N, T, F)).astype("float32")
    y = rng.integers(1, C, size=(N, T)).astype("int32")
    lengths = rng.integers(2, T + 1, size=N)
    y[np.arange(T)[None, :] >= lengths[:, None]] = 0
    return x, y


@pytest.mark.parametrize("strategy", ["single", "dp", "fsdp"])
@pytest.mark.parametrize("weighted", [False, True])
def test_ignore_class_reduces_over_the_valid_tokens_as_keras(padded, data, strategy, weighted):
    """``ignore_class=0``: a batch's loss is the mean over its tokens of another class (with per-token weights:
    their weighted sum over that count), as Keras 3 reduces it, on one device and on 8, from trainkit's loss
    object and from Keras's own."""
    x, y = padded
    w = data[2] if weighted else None
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((T, F)), keras.layers.Dense(C)])
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0),
    )
    kernel, bias = model.get_weights()
    fit = {"sample_weight": w, "epochs": 2, "batch_size": BATCH, "shuffle": False, "verbose": 0}
    theirs = model.fit(x, y, **fit).history["loss"]
    for loss in (tk.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0), model.loss):
        trainer = tk.Trainer(
            nn.Dense(C), loss=loss, optimizer=optax.sgd(0.5), strategy=strategy, params={"kernel": kernel, "bias": bias}
        )
        np.testing.assert_allclose(trainer.fit(x, y, **fit).history["loss"], theirs, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(trainer.params["kernel"], model.get_weights()[0], rtol=1e-5, atol=1e-6)
        evaluated = model.evaluate(x, y, sample_weight=w, batch_size=BATCH, verbose=0)
        np.testing.assert_allclose(trainer.evaluate(x, y, sample_weight=w, batch_size=BATCH), evaluated, rtol=1e-5)


def test_an_ignored_class_outside_the_classes_is_no_label_error(padded):
    """Keras users pad with -1 as often as with 0: the ignored class need not be a class, and the label checks
    (the host's and the step's) leave it alone while still naming a real stray label."""
    x, y = padded
    y = np.where(y == 0, -1, y)
    loss = tk.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1)
    trainer = tk.Trainer(nn.Dense(C), loss=loss, optimizer=optax.sgd(0.5), strategy="single")
    assert np.isfinite(trainer.fit(x, y, batch_size=BATCH, verbose=0).history["loss"][0])
    stray = y.copy()
    stray[7, 0] = C
    with pytest.raises(ValueError, match=f"holds label {C}"):
        trainer.fit(x, stray, batch_size=BATCH, verbose=0)


def test_ignore_class_with_a_train_step_of_your_own_is_refused_by_name(padded):
    x, y = padded

    class OwnStep(tk.Trainer):
        def train_step(self, state, batch, rng):
            return state, {}

    loss = tk.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)
    trainer = OwnStep(nn.Dense(C), loss=loss, optimizer=optax.sgd(0.5), strategy="single")
    with pytest.raises(ValueError, match=r"ignores a class \(ignore_class\), and this trainer's train_step is its own"):
        trainer.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


def test_ignore_class_over_micro_batches_counts_the_whole_batch_s_tokens(padded, data):
    """Under gradient accumulation the valid tokens are counted over the whole batch, not per micro-batch:
    the same parameters and loss as one step over the batch (and per-token weights the same way)."""
    x, y = padded
    runs = []
    for accumulate in (1, 2):
        loss = tk.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)
        trainer = tk.Trainer(nn.Dense(C), loss=loss, optimizer=optax.sgd(0.5), grad_accum_steps=accumulate)
        history = trainer.fit(x, y, sample_weight=data[2], batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        runs.append((history.history["loss"], trainer.params["kernel"]))
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-5)
    np.testing.assert_allclose(runs[1][1], runs[0][1], rtol=1e-5, atol=1e-6)


def test_a_compute_loss_of_your_own_weighs_tokens_through_the_objective_as_the_error_says(data):
    """The refusal's way out: ``self.objective.loss(predictions, y, batch.get("sample_weight"))`` in a
    ``compute_loss`` of your own weighs the tokens (read so, trainkit weighs nothing again): the built-in numbers."""
    x, y, w = data

    class Own(tk.Trainer):
        def compute_loss(self, params, batch, rng, *, model_state, train):
            logits, model_state = self.apply(params, model_state, batch["x"], rng=rng, train=train)
            return self.objective.loss(logits, batch["y"], batch.get("sample_weight")), (logits, model_state)

    runs = []
    for cls in (tk.Trainer, Own):
        trainer = cls(nn.Dense(C), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.5), strategy="single")
        runs.append(trainer.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=2, shuffle=False, verbose=0))
    np.testing.assert_array_equal(runs[1].history["loss"], runs[0].history["loss"])
