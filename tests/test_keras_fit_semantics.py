"""Keras 3's ``fit`` / ``evaluate`` arguments, run side by side with Keras (JAX backend) on the
same tiny classifier (weights copied across, SGD, no shuffling): ``validation_split``,
``validation_freq``, ``validation_steps``, ``class_weight``, ``(n, 1)`` integer labels, the
``x=`` / ``y=`` keywords, weighted metrics, ``evaluate``'s return value, the loss names,
``steps_per_epoch``, the ``*_on_batch`` methods and ``count_params`` (ported from
``keras/src/trainers/trainer_test.py`` and ``data_adapters/*_test.py``). Several outputs, loss
objects, the remaining metric names and several inputs: ``test_keras_outputs.py``."""

import flax.linen as nn
import numpy as np
import optax
import pytest

import trainkit as tk
from trainkit.data import BatchRequest

keras = pytest.importorskip("keras")

N, BATCH = 50, 16


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(N, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5).astype("int32")
    return x, y


def twins(lr=0.1, strategy="single", **metrics):
    """A Keras classifier and its trainkit twin with the same weights; ``metrics`` defaults to
    ``metrics=["accuracy"]`` and may add ``weighted_metrics=[...]`` to both."""
    metrics = {"metrics": ["accuracy"], **metrics}
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(
        optimizer=keras.optimizers.SGD(lr), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **metrics
    )
    kernel, bias = model.get_weights()
    trainer = tk.Trainer(
        nn.Dense(3),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.sgd(lr),
        strategy=strategy,
        params={"kernel": kernel, "bias": bias},
        **metrics,
    )
    return model, trainer


def fit_both(x, y, epochs=3, **kwargs):
    model, trainer = twins()
    fit = {"epochs": epochs, "batch_size": BATCH, "shuffle": False, "verbose": 0, **kwargs}
    return model.fit(x, y, **fit).history, trainer.fit(x, y, **fit).history, model, trainer


def assert_histories_match(ours, theirs):
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=2e-5, atol=1e-6, err_msg=name)


def test_validation_split_takes_the_last_rows_before_shuffling(data):
    x, y = data
    theirs, ours, _, _ = fit_both(x, y, validation_split=0.3)
    assert len(ours["val_loss"]) == 3
    assert_histories_match(ours, theirs)


@pytest.mark.parametrize("freq", [2, [1, 3]])
def test_validation_freq(data, freq):
    x, y = data
    theirs, ours, _, _ = fit_both(x[:40], y[:40], epochs=4, validation_data=(x[40:], y[40:]), validation_freq=freq)
    assert len(ours["val_loss"]) == 2 and len(ours["loss"]) == 4
    assert_histories_match(ours, theirs)


def test_validation_steps(data):
    x, y = data
    theirs, ours, _, _ = fit_both(x[:30], y[:30], validation_data=(x[30:], y[30:]), validation_steps=1)
    assert_histories_match(ours, theirs)


def test_class_weight(data):
    x, y = data
    weights = {0: 0.5, 1: 2.0, 2: 1.0}
    theirs, ours, _, _ = fit_both(x, y, class_weight=weights)
    assert_histories_match(ours, theirs)
    unweighted = twins()[1].fit(x, y, epochs=3, batch_size=BATCH, shuffle=False, verbose=0).history
    assert unweighted["loss"] != pytest.approx(ours["loss"])  # the weights changed something


def test_integer_labels_of_shape_n_by_1(data):
    x, y = data
    theirs, ours, model, trainer = fit_both(x, y[:, None])
    assert_histories_match(ours, theirs)
    keras_eval = model.evaluate(x, y[:, None], batch_size=BATCH, verbose=0, return_dict=True)
    ours_eval = trainer.evaluate(x, y[:, None], batch_size=BATCH, return_dict=True)
    assert ours_eval == pytest.approx(keras_eval, rel=2e-5)


def test_keyword_arguments_as_keras_spells_them(data):
    x, y = data
    model, trainer = twins()
    history = trainer.fit(x=x, y=y, epochs=1, batch_size=BATCH, shuffle=False, verbose=0)
    model.fit(x=x, y=y, epochs=1, batch_size=BATCH, shuffle=False, verbose=0)
    assert trainer.evaluate(x=x, y=y, batch_size=BATCH) == pytest.approx(
        model.evaluate(x=x, y=y, batch_size=BATCH, verbose=0), rel=2e-5
    )
    assert trainer.predict(x=x).shape == (N, 3) and len(history.epoch) == 1


def test_positional_arguments_in_keras_order(data):
    """``fit(x, y, 16, 2, 0)`` as Keras reads it; Keras's parameters are a prefix of ours."""
    import inspect

    for ours, theirs in ((tk.Trainer.fit, keras.Model.fit), (tk.Trainer.evaluate, keras.Model.evaluate)):
        keras_names = [p for p in inspect.signature(theirs).parameters if p not in ("self", "kwargs")]
        assert list(inspect.signature(ours).parameters)[1 : len(keras_names) + 1] == keras_names
    keras_names = list(inspect.signature(keras.Model.predict).parameters)[1:]
    assert list(inspect.signature(tk.Trainer.predict).parameters)[1 : len(keras_names) + 1] == keras_names
    x, y = data
    model, trainer = twins()
    ours = trainer.fit(x, y, BATCH, 2, 0, None, 0.0, None, False).history
    theirs = model.fit(x, y, BATCH, 2, 0, None, 0.0, None, False).history
    assert_histories_match(ours, theirs)
    assert trainer.evaluate(x, y, BATCH, 0) == pytest.approx(model.evaluate(x, y, BATCH, 0), rel=2e-5)
    np.testing.assert_allclose(trainer.predict(x, BATCH, 0), model.predict(x, BATCH, 0), rtol=1e-5, atol=1e-6)


def test_zero_epochs_train_nothing_and_return_an_empty_history_as_keras(data):
    x, y = data
    model, trainer = twins()
    events = []

    def note(name):
        return lambda *args, **kwargs: events.append(name)

    hooks = {f"on_{name}": note(name) for name in ("train_begin", "train_end", "epoch_begin")}
    theirs = model.fit(x, y, epochs=0, verbose=0, callbacks=[keras.callbacks.LambdaCallback(**hooks)])
    keras_events, events[:] = list(events), []
    before = trainer.get_weights() if trainer.state is not None else None
    ours = trainer.fit(x, y, epochs=0, verbose=0, callbacks=[tk.callbacks.LambdaCallback(**hooks)])
    assert ours.history == theirs.history == {} and ours.epoch == theirs.epoch == []
    assert events == keras_events == ["train_begin", "train_end"]
    assert before is None and trainer.global_step == 0


def test_count_params_counts_what_keras_counts(data):
    model, trainer = twins()
    trainer.init(data[0])
    assert trainer.count_params() == model.count_params() == 4 * 3 + 3


def test_keras_refusals(data, tmp_path):
    x, y = data
    model, trainer = twins()
    weights = np.ones(N, np.float32)
    with pytest.raises(ValueError, match="`class_weight` and `sample_weight`"):
        model.fit(x, y, sample_weight=weights, class_weight={0: 1.0}, verbose=0)
    with pytest.raises(ValueError, match="`class_weight` and `sample_weight`"):
        trainer.fit(x, y, sample_weight=weights, class_weight={0: 1.0}, verbose=0)
    with pytest.raises(ValueError, match="not sufficient to split"):
        trainer.fit(x[:2], y[:2], validation_split=0.6, verbose=0)
    with pytest.raises(ValueError, match="validation_split is only supported for arrays"):
        trainer.fit([(x[:16], y[:16])], validation_split=0.5, verbose=0)
    with pytest.raises(ValueError, match="validation_freq must be a positive integer"):
        trainer.fit(x, y, validation_freq=0, verbose=0)
    for keras_callback in (
        keras.callbacks.EarlyStopping(monitor="loss", patience=2),
        keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
        keras.callbacks.TerminateOnNaN(),
        keras.callbacks.ReduceLROnPlateau(),
    ):
        name = type(keras_callback).__name__
        with pytest.raises(TypeError, match=rf"keras.callbacks.{name}, a Keras callback.*tk.callbacks.{name}\(...\)"):
            trainer.fit(x, y, callbacks=[keras_callback], verbose=0)
    assert trainer.state is None  # all refused before anything was built


def test_sample_weights_apply_to_weighted_metrics_only(data):
    x, y = data
    w = np.linspace(0.0, 2.0, N).astype("float32")
    model, trainer = twins(weighted_metrics=["accuracy"])
    theirs = model.fit(x, y, sample_weight=w, epochs=2, batch_size=BATCH, shuffle=False, verbose=0).history
    ours = trainer.fit(x, y, sample_weight=w, epochs=2, batch_size=BATCH, shuffle=False, verbose=0).history
    assert sorted(ours) == ["accuracy", "loss", "weighted_accuracy"]
    assert_histories_match(ours, theirs)


def test_evaluate_returns_what_keras_returns(data):
    x, y = data
    model, trainer = twins()
    trainer.init(x)
    loss, accuracy = trainer.evaluate(x, y, batch_size=BATCH)
    keras_loss, keras_accuracy = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    assert (loss, accuracy) == pytest.approx((keras_loss, keras_accuracy), rel=2e-5)
    assert trainer.evaluate(x, y, batch_size=BATCH, return_dict=True) == pytest.approx(
        model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True), rel=2e-5
    )
    loss_only = tk.Trainer(
        nn.Dense(3), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single"
    )
    assert isinstance(loss_only.evaluate(x, y, batch_size=BATCH), float)  # a scalar, as Keras


class SoftmaxHead(nn.Module):
    """A model ported from Keras with its final softmax."""

    @nn.compact
    def __call__(self, x):
        return nn.softmax(nn.Dense(3)(x))


@pytest.mark.parametrize(
    "loss, head, reading",
    [
        ("sparse_categorical_crossentropy", "softmax", "SparseCategoricalCrossentropy"),
        ("categorical_crossentropy", "softmax", "CategoricalCrossentropy"),
        ("binary_crossentropy", "sigmoid", "BinaryCrossentropy"),
        ("crossentropy", "sigmoid", "BinaryCrossentropy"),  # Keras's pick from the shapes: binary
    ],
)
def test_probabilities_into_a_logits_loss_stop_fit_before_any_update(data, loss, head, reading):
    """A Keras port keeps its final softmax and Keras's string loss: trainkit's names take logits,
    so that would train on another loss. It stops before the first update, naming the loss that
    reads probabilities; that loss then trains as Keras does."""
    x, y = data
    targets = {"sparse_categorical_crossentropy": y, "categorical_crossentropy": np.eye(3, dtype="float32")[y]}
    targets = targets.get(loss, (y > 0).astype("float32")[:, None])
    units = 1 if head == "sigmoid" else 3

    class Head(nn.Module):
        @nn.compact
        def __call__(self, x):
            out = nn.Dense(units)(x)
            return nn.sigmoid(out) if head == "sigmoid" else nn.softmax(out)

    trainer = tk.Trainer(Head(), loss=loss, optimizer=optax.sgd(0.1), strategy="single")
    with pytest.raises(
        ValueError, match=rf"look like probabilities.*loss '{loss}' takes logits.*tk.losses.{reading}\(\)"
    ):
        trainer.fit(x, targets, epochs=1, batch_size=BATCH, verbose=0)
    assert trainer.global_step == 0  # nothing trained on the wrong loss
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(units, activation=head)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    kernel, bias = model.get_weights()
    theirs = model.fit(x, targets, epochs=2, batch_size=BATCH, shuffle=False, verbose=0).history
    fixed = tk.Trainer(
        Head(),
        loss=getattr(tk.losses, reading)(),
        optimizer=optax.sgd(0.1),
        strategy="single",
        params={"Dense_0": {"kernel": kernel, "bias": bias}},
    )
    ours = fixed.fit(x, targets, epochs=2, batch_size=BATCH, shuffle=False, verbose=0).history
    np.testing.assert_allclose(ours["loss"], theirs["loss"], rtol=2e-5)
    tk.Trainer(nn.Dense(units), loss=loss, optimizer=optax.sgd(0.1), strategy="single").fit(
        x, targets, batch_size=BATCH, verbose=0
    )  # logits: trains


def test_a_model_that_mixes_rows_is_stopped_before_training_unless_it_says_so():
    class MeanOverBatch(nn.Module):  # every row's output depends on the whole batch
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(x - x.mean(axis=0, keepdims=True))

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype("float32"), rng.integers(0, 3, 32).astype("int32")
    trainer = tk.Trainer(MeanOverBatch(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"mixes the rows of a batch.*inputs float32\[16, 4\].*mixes_rows=True"):
        trainer.fit(x, y, batch_size=16, verbose=0)
    assert trainer.global_step == 0
    tk.Trainer(MeanOverBatch(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), mixes_rows=True).fit(
        x, y, batch_size=16, epochs=1, verbose=0
    )  # the opt-out


def test_keras_loss_objects_and_keras_order_functions_match_keras(data):
    x, y = data
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    kernel, bias = model.get_weights()
    theirs = model.fit(x, y, epochs=2, batch_size=BATCH, shuffle=False, verbose=0).history
    for loss in (
        keras.losses.SparseCategoricalCrossentropy(),
        tk.losses.keras_order(keras.losses.sparse_categorical_crossentropy),
    ):
        trainer = tk.Trainer(
            SoftmaxHead(),
            loss=loss,
            optimizer=optax.sgd(0.1),
            strategy="single",
            params={"Dense_0": {"kernel": kernel, "bias": bias}},
        )
        ours = trainer.fit(x, y, epochs=2, batch_size=BATCH, shuffle=False, verbose=0).history
        np.testing.assert_allclose(ours["loss"], theirs["loss"], rtol=2e-5)


def test_stateful_keras_metric_objects_are_refused_with_the_way_out():
    with pytest.raises(TypeError, match=r"stateful Keras metric object.*named \(y_true, y_pred\)"):
        tk.Trainer(nn.Dense(3), loss="mse", optimizer=optax.sgd(0.1), metrics=[keras.metrics.MeanAbsoluteError()])


# ---------------------------------------------------------------------- loss and metric names
def _targets(kind, rng):
    if kind == "probabilities":
        logits = rng.normal(size=(N, 3))
        return (np.exp(logits) / np.exp(logits).sum(1, keepdims=True)).astype("float32")
    if kind == "binary":
        return rng.integers(0, 2, size=(N, 3)).astype("float32")
    if kind == "one_hot":
        return np.eye(3, dtype="float32")[rng.integers(0, 3, size=N)]
    return rng.uniform(0.1, 2.0, size=(N, 3)).astype("float32")


LOSS_NAMES = {  # name: (targets, softmax outputs)
    "huber": ("positive", False),
    "log_cosh": ("positive", False),
    "mape": ("positive", False),
    "msle": ("positive", True),
    "cosine_similarity": ("positive", False),
    "kl_divergence": ("probabilities", True),
    "poisson": ("positive", True),
    "hinge": ("binary", False),
    "squared_hinge": ("binary", False),
    "categorical_hinge": ("one_hot", False),
    "mse": ("positive", False),
    "mae": ("positive", False),
    "mean_squared_error": ("positive", False),
    "mean_absolute_error": ("positive", False),
    "mean_absolute_percentage_error": ("positive", False),
    "mean_squared_logarithmic_error": ("positive", True),
    "kld": ("probabilities", True),
    "logcosh": ("positive", False),
}


CROSS_ENTROPY_NAMES = {  # compared with Keras (from_logits=True) in test_keras_outputs.py
    "crossentropy",
    "ce",
    "sparse_categorical_crossentropy",
    "categorical_crossentropy",
    "binary_crossentropy",
    "binary_focal_crossentropy",
    "categorical_focal_crossentropy",
}


def test_every_loss_name_is_compared_with_keras():
    assert set(tk.losses.LOSSES) == set(LOSS_NAMES) | CROSS_ENTROPY_NAMES


@pytest.mark.parametrize("name", sorted(LOSS_NAMES))
def test_loss_names_match_keras_under_padding_on_8_devices(data, name):
    x, _ = data
    kind, softmax = LOSS_NAMES[name]
    y = _targets(kind, np.random.default_rng(2))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax" if softmax else None)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss={"logcosh": "log_cosh"}.get(name, name))  # Keras lacks it
    kernel, bias = model.get_weights()
    trainer = tk.Trainer(
        SoftmaxHead() if softmax else nn.Dense(3),
        loss=name,
        optimizer=optax.sgd(0.1),
        strategy=tk.DataParallel(),
        params={"Dense_0": {"kernel": kernel, "bias": bias}} if softmax else {"kernel": kernel, "bias": bias},
    )
    theirs = model.evaluate(x, y, batch_size=16, verbose=0)  # 50 rows: the last batch holds 2
    assert trainer.evaluate(x, y, batch_size=16) == pytest.approx(theirs, rel=1e-5, abs=1e-6)


METRIC_NAMES = {  # name: targets
    "mean_absolute_error": "positive",
    "mean_squared_error": "positive",
    "mape": "positive",
    "msle": "positive",
    "cosine_similarity": "positive",
    "log_cosh_error": "positive",
    "hinge": "binary",
    "squared_hinge": "binary",
    "categorical_hinge": "one_hot",
    "top_k_categorical_accuracy": "one_hot",
    "categorical_accuracy": "one_hot",
}


def test_metric_names_match_keras_under_padding_on_8_devices(data):
    x, _ = data
    for kind in sorted(set(METRIC_NAMES.values())):
        names = sorted(n for n, k in METRIC_NAMES.items() if k == kind)
        y = _targets(kind, np.random.default_rng(3))
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=names)
        kernel, bias = model.get_weights()
        trainer = tk.Trainer(
            nn.Dense(3),
            loss="mse",
            metrics=names,
            optimizer=optax.sgd(0.1),
            strategy=tk.DataParallel(),
            params={"kernel": kernel, "bias": bias},
        )
        theirs = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
        ours = trainer.evaluate(x, y, batch_size=16, return_dict=True)
        assert set(ours) == set(theirs)
        for name in theirs:
            assert ours[name] == pytest.approx(theirs[name], rel=1e-5, abs=1e-6), name


def test_shuffle_batch_permutes_rows_inside_each_batch_as_keras(data):
    x, y = data
    from trainkit.data import ArrayDataset

    dataset = ArrayDataset(x, y)
    plain = list(dataset.batches(BATCH))
    mixed = list(dataset.batches(BATCH, BatchRequest(shuffle="batch", seed=0, epoch=1)))
    assert len(plain) == len(mixed) == 4
    moved = 0
    for a, b in zip(plain, mixed):  # the same rows in every batch, in another order
        real = int(a["mask"].sum())
        assert int(b["mask"].sum()) == real
        assert sorted(map(tuple, a["x"][:real].tolist())) == sorted(map(tuple, b["x"][:real].tolist()))
        moved += not np.array_equal(a["x"], b["x"])
    assert moved >= 3
    model, trainer = twins()
    ours = trainer.fit(x, y, epochs=2, batch_size=BATCH, shuffle="batch", verbose=0).history
    theirs = twins()[1].fit(x, y, epochs=2, batch_size=BATCH, shuffle=False, verbose=0).history
    np.testing.assert_allclose(ours["loss"], theirs["loss"], rtol=1e-5)  # a batch's mean ignores row order
    with pytest.raises(ValueError, match="shuffle must be True, False or 'batch'"):
        trainer.fit(x, y, shuffle="rows", verbose=0)


def test_all_zero_sample_weights_report_keras_values(data):
    x, y = data
    model, trainer = twins(weighted_metrics=["accuracy"])
    zeros = np.zeros(N, np.float32)
    theirs = model.evaluate(x, y, sample_weight=zeros, batch_size=BATCH, verbose=0, return_dict=True)
    ours = trainer.evaluate(x, y, sample_weight=zeros, batch_size=BATCH, return_dict=True)
    assert ours == pytest.approx(theirs, abs=1e-7) and ours["weighted_accuracy"] == 0.0 and ours["loss"] == 0.0


@pytest.mark.parametrize("strategy", ["single", "dp"])
def test_on_batch_methods_match_keras(data, strategy):
    x, y = data
    model, trainer = twins(strategy=strategy)
    for rows in (slice(0, 10), slice(10, 23)):  # 10 and 13 rows: not multiples of 8 devices
        theirs = model.train_on_batch(x[rows], y[rows])
        ours = trainer.train_on_batch(x[rows], y[rows])
        assert ours == pytest.approx(theirs, rel=2e-5)
    assert trainer.test_on_batch(x[:7], y[:7], return_dict=True) == pytest.approx(
        model.test_on_batch(x[:7], y[:7], return_dict=True), rel=2e-5
    )
    np.testing.assert_allclose(trainer.predict_on_batch(x[:5]), model.predict_on_batch(x[:5]), rtol=2e-5, atol=1e-6)
    assert trainer.global_step == int(model.optimizer.iterations) == 2


class PortedCNN(nn.Module):
    """Keras's Sequential below, ported: pooling and flattening are functions in Flax, not modules."""

    @nn.compact
    def __call__(self, x, train=False):
        x = nn.relu(nn.Conv(4, (3, 3), padding="VALID")(x))
        x = nn.max_pool(x, (2, 2), (2, 2)).reshape((x.shape[0], -1))
        x = nn.BatchNorm(use_running_average=not train, momentum=0.99, epsilon=1e-3)(x)
        return nn.Dense(10)(nn.Dropout(0.5, deterministic=not train)(x))


def keras_lines(model):
    lines = []
    model.summary(print_fn=lambda line, line_break=False: lines.append(line))
    return "\n".join(lines)


def test_summary_shows_every_module_shape_and_count_as_keras(data):
    import io
    import re

    from rich.console import Console

    from trainkit.monitoring.summary import summary_rows

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 8, 8, 1)).astype("float32"), rng.integers(0, 10, 32).astype("int32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(10),
        ]
    )
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    trainer = tk.Trainer(PortedCNN(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3))
    buffer = io.StringIO()
    trainer.summary((x, y), console=Console(file=buffer, width=150))  # before fit: traced on the sample
    assert trainer.state is None and trainer.strategy is None  # "auto" chose nothing: no candidate compiled
    model.fit(x, y, epochs=1, verbose=0)  # Keras builds its optimizer (and counts it) at the first step
    ours, theirs = buffer.getvalue(), keras_lines(model)
    keras_rows = {
        type(layer).__name__: (str(tuple(layer.output.shape)), layer.count_params())
        for layer in model.layers
        if not isinstance(layer, keras.layers.MaxPooling2D | keras.layers.Flatten)
    }
    flax_names = {"Conv": "Conv2D", "BatchNorm": "BatchNormalization", "Dropout": "Dropout", "Dense": "Dense"}
    inputs = trainer.setup.summary_inputs((x, y))
    rows = summary_rows(trainer.setup.program.adapter, inputs.state, inputs.x)
    assert {flax_names[r.kind]: (r.output_shape, r.params) for r in rows} == keras_rows  # Dropout too: 0 params
    for name in ("Trainable params", "Non-trainable params"):
        assert re.search(rf"{name}: .*\)", ours).group() == re.search(rf"{name}: .*\)", theirs).group()
    count = lambda text: int(re.search(r"Optimizer params: ([\d,]+)", text).group(1).replace(",", ""))  # noqa: E731
    assert abs(count(ours) - count(theirs)) <= 2  # Adam's moments; optax keeps one step count, Keras two scalars
    flops = re.search(r"Train step FLOPs: ([\d,]+) per batch of 32", ours).group(1)
    trainer.init((x, y))  # the same count once a strategy places the step (up to its reductions' few flops)
    placed = tk.monitoring.debug.step_flops(trainer, trainer.setup.placed_sample((x, y)))
    assert int(flops.replace(",", "")) == pytest.approx(placed, rel=1e-3)
    trainer.fit(x, y, epochs=1, verbose=0)
    assert f"Total params: {trainer.count_params() + count(ours):,}" in trainer_text(trainer)


def trainer_text(trainer):
    import io

    from rich.console import Console

    buffer = io.StringIO()
    trainer.summary(console=Console(file=buffer, width=150))  # after fit: no sample needed
    return buffer.getvalue()


def test_summary_before_any_shapes_says_what_to_pass():
    trainer = tk.Trainer(nn.Dense(2), loss="mse", optimizer=optax.sgd(0.1))
    with pytest.raises(RuntimeError, match=r"pass a sample batch, trainer.summary\(\(x\[:32\], y\[:32\]\)\)"):
        trainer.summary()


def test_steps_per_epoch_walks_on_through_the_data_as_keras(data):
    x, y = data  # 50 rows in batches of 16: 4 batches per pass
    theirs, ours, model, trainer = fit_both(x, y, epochs=3, steps_per_epoch=3)
    assert_histories_match(ours, theirs)  # epoch 1 ends with the pass (1 batch); epoch 2 starts the next
    for a, b in zip(jax_leaves(trainer), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    assert trainer.global_step == int(model.optimizer.iterations) == 3 + 1 + 3


def jax_leaves(trainer):
    weights = trainer.get_weights()["params"]
    return [weights["kernel"], weights["bias"]]


class Batches:
    """A re-iterable with a length (as a Keras ``PyDataset`` is): a fresh pass per ``iter``."""

    def __init__(self, x, y, size):
        self.parts = [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]

    def __len__(self):
        return len(self.parts)

    def __iter__(self):
        return iter(self.parts)


def test_steps_per_epoch_walks_on_through_a_re_iterable_as_keras(data):
    x, y = data
    model, trainer = twins()

    class KerasBatches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()
            self.batches = Batches(x, y, BATCH)

        def __len__(self):
            return len(self.batches)

        def __getitem__(self, index):
            return self.batches.parts[index]

    theirs = model.fit(KerasBatches(), epochs=3, steps_per_epoch=3, shuffle=False, verbose=0).history
    ours = trainer.fit(Batches(x, y, BATCH), epochs=3, steps_per_epoch=3, verbose=0).history
    assert_histories_match(ours, theirs)
    assert trainer.global_step == int(model.optimizer.iterations) == 3 + 1 + 3


def test_early_stopping_on_a_metric_of_unknown_direction_raises_as_keras(data):
    x, y = data
    model, trainer = twins()

    def keras_score(y_true, y_pred):  # a metric of your own: only its author knows its direction
        return y_pred[:, 0]

    def my_score(predictions, targets):  # the same, in trainkit's (optax's) argument order
        return predictions[:, 0]

    keras_score.__name__ = "my_score"
    for monitor in ("unknown", "my_score"):
        with pytest.raises(ValueError, match="maximized or minimized"):
            model.compile(loss=model.loss, optimizer=keras.optimizers.SGD(0.1), metrics=[keras_score])
            model.fit(x, y, epochs=1, verbose=0, callbacks=[keras.callbacks.EarlyStopping(monitor=monitor)])
        trainer = tk.Trainer(
            nn.Dense(3), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), metrics=[my_score]
        )
        with pytest.raises(ValueError, match=rf"monitor='{monitor}' with mode='auto'.*maximized or minimized"):
            trainer.fit(x, y, epochs=1, verbose=0, callbacks=[tk.callbacks.EarlyStopping(monitor=monitor)])
    stopper = tk.callbacks.EarlyStopping(monitor="mae", patience=0)  # a known metric says its direction
    trainer = tk.Trainer(nn.Dense(1), loss="mse", optimizer=optax.sgd(0.1), metrics=["mae"])
    trainer.fit(x, y[:, None].astype("float32"), epochs=2, verbose=0, callbacks=[stopper])
    assert stopper.mode == "min"
    assert tk.callbacks.EarlyStopping(monitor="val_mae", mode="max").mode == "max"  # your word is kept


def test_functions_named_keras_s_way_get_keras_s_order(data):
    """An asymmetric metric and loss written for Keras, ``fn(y_true, y_pred)``: the same values
    as Keras; a function with other names keeps optax's order."""
    x, y = data
    targets = y[:, None].astype("float32")

    def signed_error(y_true, y_pred):  # asymmetric: a swap flips its sign
        return keras.ops.mean(y_pred - y_true, axis=-1)

    def keras_mse(y_true, y_pred):
        return keras.ops.mean((y_pred - y_true) ** 2 + 0.1 * (y_pred - y_true), axis=-1)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=keras_mse, metrics=[signed_error])
    kernel, bias = model.get_weights()
    theirs = model.fit(x, targets, epochs=2, batch_size=BATCH, shuffle=False, verbose=0).history
    trainer = tk.Trainer(
        nn.Dense(1),
        loss=keras_mse,
        optimizer=optax.sgd(0.05),
        metrics=[signed_error],
        strategy="single",
        params={"kernel": kernel, "bias": bias},
    )
    ours = trainer.fit(x, targets, epochs=2, batch_size=BATCH, shuffle=False, verbose=0).history
    assert_histories_match(ours, theirs)

    def optax_order(predictions, targets):  # any other names: (predictions, targets)
        return (predictions - targets).mean(axis=-1)

    assert tk.losses.in_keras_order(optax_order) is optax_order


def test_verbose_2_prints_keras_s_epoch_lines(data, capsys):
    """``fit(verbose=2)``: Keras's ``Epoch 1/2`` then ``4/4 - 0s - 3ms/step - loss: ...`` per
    epoch, with the same counts and keys (the times differ)."""
    import io
    import re

    from rich.console import Console

    x, y = data
    model, trainer = twins()
    model.fit(x, y, epochs=2, batch_size=BATCH, verbose=2, validation_data=(x, y))
    theirs = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    buffer = io.StringIO()
    bar = tk.callbacks.ProgressBar(verbose=2, console=Console(file=buffer, width=300))
    trainer.fit(x, y, epochs=2, batch_size=BATCH, verbose=2, validation_data=(x, y), callbacks=[bar])
    ours = [line for line in buffer.getvalue().splitlines() if line.strip()]
    ledger = ours.index(next(line for line in ours if line.startswith("Where the time went:")))
    ours = ours[:ledger]  # then trainkit's goodput table (docs/keras_differences.md), after Keras's lines

    def shape(line):  # times and values out; counts, order and keys kept
        return re.sub(
            r"\d+(ms|us|s)/step",
            "T/step",
            re.sub(r" - \d+s - ", " - Ts - ", re.sub(r": -?[\d.]+(e[-+]\d+)?", ": v", line)),
        )

    assert [shape(line) for line in ours] == [shape(line) for line in theirs], (ours, theirs)
    assert ours[0] == "Epoch 1/2" and re.fullmatch(
        r"4/4 - \d+s - \d+(ms|us|s)/step - accuracy: [\d.]+ - loss: .*", ours[1]
    )
