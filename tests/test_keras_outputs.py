"""Keras 3's multi-output training, loss objects with ``from_logits``, focal cross-entropies,
the metrics that are not means (AUC, precision, recall, RMSE, R^2), cross-entropies as metrics
and multi-input ``predict``, each run side by side with Keras (JAX backend) on the same tiny
problem with the weights copied across. Most comparisons run on 8 devices with a ragged last
batch (50 rows, batches of 16), so the padded rows must not count (ported from
``keras/src/trainers/trainer_test.py::test_loss_weights``, ``test_nested_inputs``,
``test_nested_input_predict`` and ``keras/src/metrics/*_test.py``)."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from conftest import PairInputs

import trainkit as tk

keras = pytest.importorskip("keras")

N, BATCH = 50, 16


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(1).normal(size=(N, 4)).astype("float32")


def keras_dense(units, activation=None, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(units, activation=activation)])
    kernel, bias = model.get_weights()
    return model, {"Dense_0": {"kernel": kernel, "bias": bias}}


class Head(nn.Module):
    units: int
    activation: str | None = None

    @nn.compact
    def __call__(self, x):
        out = nn.Dense(self.units)(x)
        return {"softmax": nn.softmax, "sigmoid": nn.sigmoid, None: lambda v: v}[self.activation](out)


def targets(kind, rng, units=3):
    if kind == "sparse":
        return rng.integers(0, units, size=N).astype("int32")
    if kind == "one_hot":
        return np.eye(units, dtype="float32")[rng.integers(0, units, size=N)]
    if kind == "binary":
        return rng.integers(0, 2, size=(N, units)).astype("float32")
    return rng.normal(size=(N, units)).astype("float32")


# ---------------------------------------------------------------------- loss objects
LOSS_OBJECTS = {  # class name: (targets, options)
    "SparseCategoricalCrossentropy": ("sparse", {}),
    "CategoricalCrossentropy": ("one_hot", {"label_smoothing": 0.1}),
    "BinaryCrossentropy": ("binary", {"label_smoothing": 0.1}),
    "BinaryFocalCrossentropy": ("binary", {"apply_class_balancing": True, "gamma": 1.5}),
    "CategoricalFocalCrossentropy": ("one_hot", {"alpha": 0.5}),
}


@pytest.mark.parametrize("from_logits", [False, True])
@pytest.mark.parametrize("name", sorted(LOSS_OBJECTS))
def test_loss_objects_with_from_logits_match_keras_on_8_devices(x, name, from_logits):
    kind, options = LOSS_OBJECTS[name]
    y = targets(kind, np.random.default_rng(2))
    activation = None if from_logits else ("sigmoid" if "Binary" in name else "softmax")
    model, params = keras_dense(3, activation)
    model.compile(loss=getattr(keras.losses, name)(from_logits=from_logits, **options))
    trainer = tk.Trainer(
        Head(3, activation),
        loss=getattr(tk.losses, name)(from_logits=from_logits, **options),
        optimizer=optax.sgd(0.1),
        strategy=tk.DataParallel(),
        params=params,
    )
    theirs = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    assert trainer.evaluate(x, y, batch_size=BATCH) == pytest.approx(theirs, rel=1e-5, abs=1e-6)


LOGITS_NAMES = {  # trainkit's name: (targets, Keras's class, told from_logits=True)
    "sparse_categorical_crossentropy": ("sparse", "SparseCategoricalCrossentropy"),
    "categorical_crossentropy": ("one_hot", "CategoricalCrossentropy"),
    "binary_crossentropy": ("binary", "BinaryCrossentropy"),
    "binary_focal_crossentropy": ("binary", "BinaryFocalCrossentropy"),
    "categorical_focal_crossentropy": ("one_hot", "CategoricalFocalCrossentropy"),
}


@pytest.mark.parametrize("name", sorted(LOGITS_NAMES))
def test_cross_entropy_names_take_logits_on_8_devices(x, name):
    kind, keras_class = LOGITS_NAMES[name]
    y = targets(kind, np.random.default_rng(3))
    model, params = keras_dense(3)
    model.compile(loss=getattr(keras.losses, keras_class)(from_logits=True))
    trainer = tk.Trainer(Head(3), loss=name, optimizer=optax.sgd(0.1), strategy=tk.DataParallel(), params=params)
    assert trainer.evaluate(x, y, batch_size=BATCH) == pytest.approx(
        model.evaluate(x, y, batch_size=BATCH, verbose=0), rel=1e-5
    )


@pytest.mark.parametrize(
    ("kind", "units", "activation"),
    [("sparse", 3, "softmax"), ("sparse_n_by_1", 3, "softmax"), ("one_hot", 3, "softmax"), ("binary", 1, "sigmoid")],
)
@pytest.mark.parametrize("name", ["crossentropy", "ce"])
def test_crossentropy_picks_the_loss_keras_picks_from_the_shapes(x, kind, units, activation, name):
    """Keras's loss="crossentropy" reads probabilities (its model ends in softmax / sigmoid);
    trainkit's reads logits (the same model without it): the same loss values mean the same pick."""
    rng = np.random.default_rng(4)
    y = targets("sparse", rng)[:, None] if kind == "sparse_n_by_1" else targets(kind, rng, units)
    model, params = keras_dense(units, activation)
    model.compile(loss=name)
    trainer = tk.Trainer(Head(units), loss=name, optimizer=optax.sgd(0.1), strategy=tk.DataParallel(), params=params)
    assert trainer.evaluate(x, y, batch_size=BATCH) == pytest.approx(
        model.evaluate(x, y, batch_size=BATCH, verbose=0), rel=1e-5
    )
    if kind == "sparse":  # the checks see the picked loss: labels out of range are refused before compiling
        with pytest.raises(ValueError, match="class"):
            trainer.evaluate(x, y + 3, batch_size=BATCH)


def test_a_loss_object_reading_probabilities_trains_as_keras(x):
    y = targets("sparse", np.random.default_rng(4))
    model, params = keras_dense(3, "softmax")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    theirs = model.fit(x, y, epochs=2, batch_size=BATCH, shuffle=False, verbose=0).history
    trainer = tk.Trainer(
        Head(3, "softmax"),
        loss=tk.losses.SparseCategoricalCrossentropy(),  # Keras's default: probabilities
        metrics=["accuracy"],
        optimizer=optax.sgd(0.1),
        strategy="single",
        params=params,
    )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "looks like probabilities" warning: the loss says so
        ours = trainer.fit(x, y, epochs=2, batch_size=BATCH, shuffle=False, verbose=0).history
    for key in theirs:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=2e-5, err_msg=key)


# ---------------------------------------------------------------------- metrics
PROBABILITY_METRICS = [
    "auc",
    "precision",
    "recall",
    "accuracy",
    "binary_accuracy",
    "binary_crossentropy",
    "root_mean_squared_error",
    "r2_score",
]


def _evaluate_both(x, y, loss_tk, loss_keras, metrics, activation, weights=None, weighted=False):
    model, params = keras_dense(3, activation)
    key = "weighted_metrics" if weighted else "metrics"
    model.compile(loss=loss_keras, **{key: metrics})
    trainer = tk.Trainer(
        Head(3, activation),
        loss=loss_tk,
        optimizer=optax.sgd(0.1),
        strategy=tk.DataParallel(),
        params=params,
        **{key: metrics},
    )
    theirs = model.evaluate(x, y, sample_weight=weights, batch_size=BATCH, verbose=0, return_dict=True)
    ours = trainer.evaluate(x, y, sample_weight=weights, batch_size=BATCH, return_dict=True)
    assert set(ours) == set(theirs)
    return ours, theirs


def test_stateful_and_probability_metrics_match_keras_on_8_devices(x):
    """Binary outputs read as probabilities (the loss object says from_logits=False): the
    thresholds, AUC by 200 thresholds, the roots and R^2 are computed from totals over the
    real rows, never averaged per batch or per device."""
    y = targets("binary", np.random.default_rng(5))
    ours, theirs = _evaluate_both(
        x, y, tk.losses.BinaryCrossentropy(), "binary_crossentropy", PROBABILITY_METRICS, "sigmoid"
    )
    for name in theirs:
        assert ours[name] == pytest.approx(theirs[name], rel=1e-4, abs=1e-6), name


def test_stateful_weighted_metrics_match_keras(x):
    rng = np.random.default_rng(6)
    y = targets("binary", rng)
    weights = rng.uniform(0.0, 2.0, size=N).astype("float32")
    ours, theirs = _evaluate_both(
        x,
        y,
        tk.losses.BinaryCrossentropy(),
        "binary_crossentropy",
        ["auc", "precision", "recall", "root_mean_squared_error", "r2_score"],
        "sigmoid",
        weights=weights,
        weighted=True,
    )
    for name in theirs:
        assert ours[name] == pytest.approx(theirs[name], rel=1e-4, abs=1e-6), name


def test_metrics_by_name_follow_a_logits_output(x):
    """With a logits loss (trainkit's names), thresholds and cross-entropies read logits: the
    same numbers as Keras's metric objects told from_logits=True, and as the probability
    metrics on the sigmoid of the outputs."""
    y = targets("binary", np.random.default_rng(7))
    model, params = keras_dense(3)
    model.compile(
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[
            keras.metrics.AUC(from_logits=True),
            keras.metrics.BinaryCrossentropy(from_logits=True),
            keras.metrics.BinaryAccuracy(threshold=0.0),
        ],
    )
    theirs = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    trainer = tk.Trainer(
        Head(3),
        loss="binary_crossentropy",
        metrics=["auc", "binary_crossentropy", "binary_accuracy", "precision"],
        optimizer=optax.sgd(0.1),
        strategy=tk.DataParallel(),
        params=params,
    )
    ours = trainer.evaluate(x, y, batch_size=BATCH, return_dict=True)
    assert [ours[k] for k in ("loss", "auc", "binary_crossentropy", "binary_accuracy")] == pytest.approx(
        theirs, rel=1e-4
    )
    probabilities = tk.Trainer(
        Head(3, "sigmoid"),
        loss=tk.losses.BinaryCrossentropy(),
        metrics=["precision"],
        optimizer=optax.sgd(0.1),
        strategy="single",
        params=params,
    ).evaluate(x, y, batch_size=BATCH, return_dict=True)
    assert ours["precision"] == pytest.approx(probabilities["precision"], rel=1e-6)


@pytest.mark.parametrize("kind", ["sparse", "one_hot"])
def test_cross_entropies_as_metrics_match_keras(x, kind):
    name = "sparse_categorical_crossentropy" if kind == "sparse" else "categorical_crossentropy"
    y = targets(kind, np.random.default_rng(8))
    loss = tk.losses.SparseCategoricalCrossentropy() if kind == "sparse" else "mse"  # both read probabilities
    ours, theirs = _evaluate_both(
        x, y, loss, "sparse_categorical_crossentropy" if kind == "sparse" else "mse", [name, "accuracy"], "softmax"
    )
    assert ours[name] == pytest.approx(theirs[name], rel=1e-5)
    assert ours["accuracy"] == pytest.approx(theirs["accuracy"])


METRIC_CASES = {  # every metric name: (targets, softmax outputs, Keras's name for it where Keras spells it otherwise)
    **dict.fromkeys(
        ["acc", "sparse_categorical_accuracy", "sparse_top_k_categorical_accuracy"], ("sparse", False, None)
    ),
    "top_k_accuracy": ("sparse", False, "sparse_top_k_categorical_accuracy"),
    **dict.fromkeys(
        ["categorical_accuracy", "top_k_categorical_accuracy", "categorical_hinge"], ("one_hot", False, None)
    ),
    **dict.fromkeys(
        [
            "mse",
            "mae",
            "mean_squared_error",
            "mean_absolute_error",
            "mape",
            "cosine_similarity",
            "mean_absolute_percentage_error",
        ],
        ("normal", False, None),
    ),
    "log_cosh": ("normal", False, "log_cosh_error"),
    "logcosh": ("normal", False, "log_cosh_error"),
    "log_cosh_error": ("normal", False, None),  # Keras 3's own name
    **dict.fromkeys(
        ["msle", "mean_squared_logarithmic_error", "poisson", "kl_divergence"], ("probabilities", True, None)
    ),
    **dict.fromkeys(["hinge", "squared_hinge", "AUC"], ("binary", False, None)),
}
COMPARED_ELSEWHERE = {  # by the tests above, on probabilities and on logits
    *PROBABILITY_METRICS,
    "sparse_categorical_crossentropy",
    "categorical_crossentropy",
}


def test_every_metric_name_is_compared_with_keras():
    assert set(tk.metrics.known_names()) == set(METRIC_CASES) | COMPARED_ELSEWHERE


@pytest.mark.parametrize("kind", ["sparse", "one_hot", "normal", "probabilities", "binary"])
def test_metric_names_match_keras_under_padding_on_8_devices(x, kind):
    cases = {name: case for name, case in METRIC_CASES.items() if case[0] == kind}
    softmax = next(iter(cases.values()))[1]
    y = targets(kind, np.random.default_rng(14))
    if kind == "probabilities":
        y = np.exp(y) / np.exp(y).sum(1, keepdims=True)
    model, params = keras_dense(3, "softmax" if softmax else None)
    keras_names = list(dict.fromkeys(alias or name for name, (_, _, alias) in cases.items()))
    sparse = kind == "sparse"  # Keras's mse takes no integer labels
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True) if sparse else "mse", metrics=keras_names
    )
    trainer = tk.Trainer(
        Head(3, "softmax" if softmax else None),
        loss="sparse_categorical_crossentropy" if sparse else "mse",
        metrics=list(cases),
        optimizer=optax.sgd(0.1),
        strategy=tk.DataParallel(),
        params=params,
    )
    theirs = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    ours = trainer.evaluate(x, y, batch_size=BATCH, return_dict=True)
    for name, (_, _, alias) in cases.items():
        assert ours[name] == pytest.approx(theirs[alias or name], rel=1e-5, abs=1e-6), name


def test_metric_objects_take_keras_options():
    y = np.array([0, 0, 1, 1, 1])
    scores = np.array([0.1, 0.6, 0.35, 0.8, 0.7])
    for ours, theirs in [
        (tk.metrics.AUC(num_thresholds=7, from_logits=False), keras.metrics.AUC(num_thresholds=7)),
        (tk.metrics.Precision(threshold=0.3, from_logits=False), keras.metrics.Precision(thresholds=0.3)),
        (tk.metrics.Recall(threshold=0.75, from_logits=False), keras.metrics.Recall(thresholds=0.75)),
    ]:
        theirs.update_state(y, scores)
        assert float(ours(scores, y)) == pytest.approx(float(theirs.result()), rel=1e-6)


# ---------------------------------------------------------------------- several outputs
class TwoHeads(nn.Module):
    """Outputs a dict (or a list) like a Keras functional model with two named outputs."""

    as_list: bool = False

    @nn.compact
    def __call__(self, x):
        a, b = nn.Dense(3, name="a")(x), nn.Dense(1, name="b")(x)
        return [a, b] if self.as_list else {"a": a, "b": b}


def two_head_twins(loss, metrics, loss_weights, strategy, as_list=False, weighted_metrics=None):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    a, b = keras.layers.Dense(3, name="a")(inputs), keras.layers.Dense(1, name="b")(inputs)
    model = keras.Model(inputs, [a, b] if as_list else {"a": a, "b": b})
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=loss[0],
        metrics=metrics,
        loss_weights=loss_weights,
        weighted_metrics=weighted_metrics,
    )
    ak, ab, bk, bb = model.get_weights()
    trainer = tk.Trainer(
        TwoHeads(as_list),
        loss=loss[1],
        metrics=metrics,
        weighted_metrics=weighted_metrics,
        loss_weights=loss_weights,
        optimizer=optax.sgd(0.1),
        strategy=strategy,
        params={"a": {"kernel": ak, "bias": ab}, "b": {"kernel": bk, "bias": bb}},
    )
    return model, trainer


@pytest.mark.parametrize("strategy", ["single", "dp", "fsdp"])
def test_a_dict_of_losses_with_weights_and_metrics_per_output_trains_as_keras(x, strategy):
    rng = np.random.default_rng(9)
    y = {"a": targets("sparse", rng), "b": targets("normal", rng, units=1)}
    weights = rng.uniform(0.5, 1.5, size=N).astype("float32")
    loss_keras = {"b": "mse", "a": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}
    loss_tk = {"b": "mse", "a": "sparse_categorical_crossentropy"}
    model, trainer = two_head_twins(
        (loss_keras, loss_tk),
        {"a": ["accuracy"], "b": ["mae", "mse"]},
        {"a": 1.0, "b": 0.5},
        strategy,
        weighted_metrics={"b": ["mae"]},
    )
    fit = dict(epochs=2, batch_size=BATCH, shuffle=False, verbose=0, sample_weight=weights)
    theirs = model.fit(x, y, **fit).history
    ours = trainer.fit(x, y, **fit).history
    assert (
        sorted(ours) == sorted(theirs) == ["a_accuracy", "a_loss", "b_loss", "b_mae", "b_mse", "b_weighted_mae", "loss"]
    )
    for key in theirs:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=3e-5, atol=1e-6, err_msg=key)
    # evaluate's list: the loss, the outputs' losses in the loss dict's order, the rest sorted
    np.testing.assert_allclose(
        trainer.evaluate(x, y, batch_size=BATCH), model.evaluate(x, y, batch_size=BATCH, verbose=0), rtol=3e-5
    )
    predictions = trainer.predict(x, batch_size=BATCH)
    assert set(predictions) == {"a", "b"} and predictions["b"].shape == (N, 1)


def test_a_list_of_outputs_with_one_loss_for_all_and_a_metric_per_output(x):
    """One loss applies to every output; a metrics list as long as the outputs gives one per
    output (Keras's rule). Keras names list outputs by their layers (``a``, ``b``); a Flax
    module's list has no names, so trainkit logs ``output_0``, ``output_1``."""
    rng = np.random.default_rng(10)
    y = [targets("normal", rng), targets("normal", rng, units=1)]
    model, trainer = two_head_twins((["mse", "mse"], "mse"), ["mae", "mse"], [0.3, 1.0], "dp", as_list=True)
    theirs = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    ours = trainer.evaluate(x, y, batch_size=BATCH, return_dict=True)
    renamed = {key.replace("a_", "output_0_").replace("b_", "output_1_"): v for key, v in theirs.items()}
    assert set(ours) == set(renamed) == {"loss", "output_0_loss", "output_1_loss", "output_0_mae", "output_1_mse"}
    for key in renamed:
        assert ours[key] == pytest.approx(renamed[key], rel=1e-5), key


def test_an_output_without_a_loss_is_only_predicted(x):
    rng = np.random.default_rng(11)
    y = {"a": targets("sparse", rng), "b": targets("normal", rng, units=1)}
    _, trainer = two_head_twins(
        ({"a": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}, {"a": "sparse_categorical_crossentropy"}),
        None,
        None,
        "single",
    )
    logs = trainer.evaluate(x, y, batch_size=BATCH, return_dict=True)
    assert list(logs) == ["loss"]  # one loss: no per-output entries, as Keras
    single = tk.Trainer(
        Head(3),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.sgd(0.1),
        strategy="single",
        params={"Dense_0": trainer.get_weights()["params"]["a"]},
    )
    assert logs["loss"] == pytest.approx(single.evaluate(x, y["a"], batch_size=BATCH), rel=1e-6)


def test_bad_output_specifications_fail_before_compiling(x):
    rng = np.random.default_rng(12)
    y = {"a": targets("sparse", rng), "b": targets("normal", rng, units=1)}
    make = lambda **kw: tk.Trainer(TwoHeads(), optimizer=optax.sgd(0.1), strategy="single", **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"loss names outputs \['c'\] that the targets do not have"):
        make(loss={"a": "mse", "c": "mse"}).fit(x, y, verbose=0)
    with pytest.raises(ValueError, match=r"With 2 outputs \(\['a', 'b'\]\), metrics must be a dict"):
        make(loss="mse", metrics=["mae", "mse", "mape"]).fit(x, y, verbose=0)
    with pytest.raises(ValueError, match="loss_weights=0.5 is a single value but the model has 2 outputs"):
        make(loss="mse", loss_weights=0.5).fit(x, y, verbose=0)
    with pytest.raises(ValueError, match="loss is a dict"):
        make(loss={"a": "mse", "b": "mse"}).fit(x, y["b"], verbose=0)
    with pytest.raises(ValueError, match="needs integer class ids"):
        make(loss={"a": "sparse_categorical_crossentropy", "b": "mse"}).fit(
            x, {"a": y["a"].astype("float32"), "b": y["b"]}, verbose=0
        )
    with pytest.raises(ValueError, match=r"The targets y have \['bb'\], which no output of the model has"):
        make(loss={"a": "sparse_categorical_crossentropy", "b": "mse"}).fit(x, {**y, "bb": y["b"]}, verbose=0)


# ---------------------------------------------------------------------- several inputs
def test_list_and_tuple_inputs_as_keras_takes_them():
    """Keras's ``test_nested_inputs``: ``fit([x1, x2], y)``, ``predict([x1, x2])``,
    ``predict((x1, x2))`` and ``predict_on_batch``; ones everywhere and a ones kernel give
    Keras's numbers."""
    ones = lambda *shape: np.ones(shape, np.float32)  # noqa: E731
    x1, x2, y = ones(3, 2), ones(3, 3), ones(3, 2)
    params = {
        "first": {"kernel": ones(2, 2), "bias": np.zeros(2, np.float32)},
        "second": {"kernel": ones(3, 2), "bias": np.zeros(2, np.float32)},
    }
    trainer = tk.Trainer(
        PairInputs(classes=2), loss="mse", metrics=["mse"], optimizer=optax.sgd(0.01), strategy="single", params=params
    )
    assert trainer.evaluate([x1, x2], y) == pytest.approx([16.0, 16.0])  # (5 - 1)^2
    for form in ([x1, x2], (x1, x2)):
        np.testing.assert_allclose(trainer.predict(form), np.full((3, 2), 5.0))
    np.testing.assert_allclose(trainer.predict_on_batch([x1, x2]), np.full((3, 2), 5.0))
    history = trainer.fit([x1, x2], y, verbose=0).history
    assert history["loss"] == pytest.approx([16.0])
    assert jax.tree.leaves(trainer.predict((x1, x2)))[0].shape == (3, 2)


# ---------------------------------------------------------------------- run_eagerly
CALLS = {"n": 0}


class CountingDense(nn.Module):
    """Counts its Python calls: under jit only while tracing, eagerly at every step."""

    @nn.compact
    def __call__(self, x):
        CALLS["n"] += 1
        return nn.Dense(3)(x)


@pytest.mark.parametrize("flag", [{"run_eagerly": True}, {"jit_compile": False}])
def test_run_eagerly_runs_python_every_step_and_trains_as_compiled(x, flag):
    y = targets("sparse", np.random.default_rng(13))
    results = {}
    for eager in (False, True):
        CALLS["n"] = 0
        trainer = tk.Trainer(
            CountingDense(),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            optimizer=optax.sgd(0.1),
            **(flag if eager else {"strategy": "single"}),
        )
        history = trainer.fit(x, y, epochs=2, batch_size=BATCH, verbose=0).history
        results[eager] = (history, trainer.params, trainer.evaluate(x, y, batch_size=BATCH), CALLS["n"])
    (h0, p0, e0, traced), (h1, p1, e1, eager_calls) = results[False], results[True]
    assert eager_calls >= 2 * 4 + 4 > traced  # every train step (2 epochs x 4 batches) and eval batch ran Python
    for key in h0:
        np.testing.assert_allclose(h1[key], h0[key], rtol=1e-5, err_msg=key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p1, p0)
    assert e1 == pytest.approx(e0, rel=1e-5)


def test_run_eagerly_refuses_a_multi_device_strategy():
    with pytest.raises(ValueError, match="run_eagerly=True runs each step op by op on one device"):
        tk.Trainer(nn.Dense(2), loss="mse", optimizer=optax.sgd(0.1), strategy="dp", run_eagerly=True)
    with pytest.raises(ValueError, match="jit_compile must be True, False or 'auto'"):
        tk.Trainer(nn.Dense(2), loss="mse", optimizer=optax.sgd(0.1), jit_compile="xla")


class DictInListOut(nn.Module):
    """Keras's ``test_multi_inputs_and_outputs``: a dict of inputs, a list of outputs."""

    @nn.compact
    def __call__(self, inputs):
        joined = nn.Dense(4, name="hidden")(inputs["x1"]) + nn.Dense(4, name="skip")(inputs["x2"])
        return [nn.Dense(3, name="y1")(joined), nn.Dense(4, name="y2")(joined)]


def test_dict_inputs_list_outputs_and_sample_weights_train_as_keras():
    rng = np.random.default_rng(15)
    x = {"x1": rng.random((34, 1), np.float32), "x2": rng.random((34, 2), np.float32)}
    y = [rng.random((34, 3), np.float32), rng.random((34, 4), np.float32)]
    weights = rng.random(34).astype("float32")
    keras.utils.set_random_seed(0)
    inputs = {"x1": keras.Input((1,), name="x1"), "x2": keras.Input((2,), name="x2")}
    joined = keras.layers.Dense(4, name="hidden")(inputs["x1"]) + keras.layers.Dense(4, name="skip")(inputs["x2"])
    model = keras.Model(inputs, [keras.layers.Dense(3, name="y1")(joined), keras.layers.Dense(4, name="y2")(joined)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=["mse", "mae"], weighted_metrics=[["mse"], ["mae"]])
    layer_weights = {layer.name: layer.get_weights() for layer in model.layers if layer.get_weights()}
    params = {name: {"kernel": kernel, "bias": bias} for name, (kernel, bias) in layer_weights.items()}
    trainer = tk.Trainer(
        DictInListOut(),
        loss=["mse", "mae"],
        weighted_metrics=[["mse"], ["mae"]],
        optimizer=optax.sgd(0.1),
        strategy=tk.DataParallel(),
        params=params,
    )
    fit = dict(sample_weight=weights, batch_size=16, epochs=2, shuffle=False, verbose=0)
    theirs = model.fit(x, y, **fit).history
    ours = trainer.fit(x, y, **fit).history
    rename = {"y1": "output_0", "y2": "output_1"}
    theirs = {rename.get(k.split("_")[0], k.split("_")[0]) + k[2:] if k != "loss" else k: v for k, v in theirs.items()}
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=3e-5, atol=1e-6, err_msg=key)


def test_iterables_keep_their_feature_shapes_and_must_not_be_empty():
    """Keras's generator adapter retraces for batches of new feature shapes; trainkit keeps one
    compiled shape and says which batch differs. An empty generator is a clear error in both."""
    trainer = tk.Trainer(nn.Dense(2), loss="mse", optimizer=optax.sgd(0.1), strategy="single")

    def different_shapes():
        yield np.ones([16, 4], "float32"), np.ones([16, 2], "float32")
        yield np.ones([16, 5], "float32"), np.ones([16, 2], "float32")

    with pytest.raises(ValueError, match=r"Batch 1 of the iterable has .*\(5,\).*first batch had .*\(4,\)"):
        trainer.fit(different_shapes(), verbose=0)
    with pytest.raises(ValueError, match="yielded no batch"):
        trainer.fit((batch for batch in []), verbose=0)
