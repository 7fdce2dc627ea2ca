"""Keras 3's F-scores, IoUs and constrained confusion metrics (#32), each against Keras's own
value: on one call, and through ``evaluate`` on 8 devices with a ragged last batch (50 rows in
batches of 16), from the exact totals (Keras's ``keras/src/metrics/f_score_metrics_test.py``,
``iou_metrics_test.py`` and ``confusion_metrics_test.py`` define what the same means)."""

import numpy as np
import optax
import pytest
from test_keras_outputs import BATCH, Head, N, keras_dense

import trainkit as tk

keras = pytest.importorskip("keras")


def keras_value(metric, y_true, y_pred, sample_weight=None):
    metric.update_state(y_true, y_pred, sample_weight=sample_weight)
    return np.asarray(metric.result())


@pytest.fixture(scope="module")
def classes():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(40, 4)).astype("float32")
    probabilities = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    labels = rng.integers(0, 4, size=40)
    return probabilities, labels, np.eye(4, dtype="float32")[labels], rng.uniform(0.2, 2.0, 40).astype("float32")


@pytest.mark.parametrize("average", ["micro", "macro", "weighted"])
@pytest.mark.parametrize("threshold", [None, 0.3])
def test_f_scores_equal_keras(classes, average, threshold):
    probabilities, labels, one_hot, weights = classes
    for ours, theirs in [
        (tk.metrics.F1Score(average, threshold, from_logits=False), keras.metrics.F1Score(average, threshold)),
        (
            tk.metrics.FBetaScore(average, 2.0, threshold, from_logits=False),
            keras.metrics.FBetaScore(average, 2.0, threshold),
        ),
    ]:
        state = ours.batch_state(probabilities, one_hot, mask=weights, weights=None)
        expected = keras_value(theirs, one_hot, probabilities, weights)
        assert float(state.compute()) == pytest.approx(float(expected), rel=1e-5)
        assert float(ours(probabilities, labels)) == pytest.approx(float(ours(probabilities, one_hot)))  # class ids


def test_f_scores_refuse_keras_per_class_default_with_the_fix():
    with pytest.raises(ValueError, match=r"average=None gives one per class\. Pass average='macro'"):
        tk.metrics.F1Score()


def test_ious_equal_keras(classes):
    probabilities, labels, one_hot, _ = classes
    weights = np.random.default_rng(6).integers(0, 4, 40)  # Keras's IoUs count in integers: whole weights
    predicted = probabilities.argmax(1)
    predicted[:3] = [-1, 4, 2]  # class ids out of range: never counted, as in Keras
    cases = [
        (tk.metrics.MeanIoU(4), keras.metrics.MeanIoU(4), labels, predicted),
        (tk.metrics.IoU(4, [0, 2]), keras.metrics.IoU(4, [0, 2]), labels, predicted),
        (tk.metrics.MeanIoU(4, ignore_class=1), keras.metrics.MeanIoU(4, ignore_class=1), labels, predicted),
        (
            tk.metrics.MeanIoU(4, sparse_y_true=False, sparse_y_pred=False),
            keras.metrics.MeanIoU(4, sparse_y_true=False, sparse_y_pred=False),
            one_hot,
            probabilities,
        ),
    ]
    for ours, theirs, y_true, y_pred in cases:
        expected = keras_value(theirs, y_true, y_pred, weights)
        state = ours.batch_state(y_pred, y_true, mask=weights, weights=None)
        assert float(state.compute()) == pytest.approx(float(expected), rel=1e-6), ours.__name__


CONSTRAINED = ["PrecisionAtRecall", "RecallAtPrecision", "SensitivityAtSpecificity", "SpecificityAtSensitivity"]


@pytest.mark.parametrize("name", CONSTRAINED)
@pytest.mark.parametrize("value", [0.3, 0.8])
def test_constrained_confusion_metrics_equal_keras(name, value):
    rng = np.random.default_rng(4)
    scores, labels = rng.uniform(size=(60, 3)).astype("float32"), rng.integers(0, 2, size=(60, 3))
    weights = rng.uniform(0.2, 2.0, 60).astype("float32")
    for options in ({}, {"num_thresholds": 7}, {"class_id": 1}, {"num_thresholds": 1}):
        ours = getattr(tk.metrics, name)(value, from_logits=False, **options)
        expected = keras_value(getattr(keras.metrics, name)(value, **options), labels, scores, weights)
        state = ours.batch_state(scores, labels, mask=weights, weights=None)
        assert float(state.compute()) == pytest.approx(float(expected), rel=1e-5, abs=1e-7), (name, options)


def test_the_new_metrics_evaluate_as_keras_on_8_devices_with_a_ragged_batch():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(N, 4)).astype("float32")
    y = np.eye(3, dtype="float32")[rng.integers(0, 3, size=N)]
    model, params = keras_dense(3, "softmax")
    keras_metrics = [  # named: Keras numbers a default name taken earlier in the process (mean_io_u_1)
        keras.metrics.F1Score("macro", name="f1_score"),
        keras.metrics.FBetaScore("weighted", 0.5, 0.4, name="fbeta_score"),
        keras.metrics.MeanIoU(3, sparse_y_true=False, sparse_y_pred=False, name="mean_io_u"),
        keras.metrics.PrecisionAtRecall(0.5, class_id=2, name="precision_at_recall"),
        keras.metrics.SpecificityAtSensitivity(0.6, num_thresholds=11, class_id=0, name="specificity_at_sensitivity"),
    ]
    model.compile(loss="categorical_crossentropy", metrics=keras_metrics)
    ours = [
        tk.metrics.F1Score("macro"),
        tk.metrics.FBetaScore("weighted", 0.5, 0.4),
        tk.metrics.MeanIoU(3, sparse_y_true=False, sparse_y_pred=False),
        tk.metrics.PrecisionAtRecall(0.5, class_id=2),
        tk.metrics.SpecificityAtSensitivity(0.6, num_thresholds=11, class_id=0),
    ]
    trainer = tk.Trainer(
        Head(3, "softmax"),
        loss=tk.losses.CategoricalCrossentropy(from_logits=False),
        metrics=ours,
        optimizer=optax.sgd(0.1),
        strategy=tk.DataParallel(),
        params=params,
    )
    theirs = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    got = trainer.evaluate(x, y, batch_size=BATCH, return_dict=True)
    for name in ("f1_score", "fbeta_score", "mean_io_u", "precision_at_recall", "specificity_at_sensitivity"):
        assert got[name] == pytest.approx(float(theirs[name]), rel=1e-5, abs=1e-6), (name, got, theirs)


def test_early_stopping_knows_which_way_the_new_metrics_improve():
    assert tk.metrics.direction("my_f1", tk.metrics.F1Score("macro")) == "max"
    assert tk.metrics.direction("rmse", tk.metrics.RootMeanSquaredError()) == "min"
    assert tk.metrics.direction("mean_io_u", tk.metrics.MeanIoU(3)) == "max"
