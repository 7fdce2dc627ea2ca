"""Per-batch metric functions (used inside the step), by Keras's names.

A metric is ``metric(predictions, targets) -> per-example values`` (one that returns the batch's
mean is evaluated row by row, so the padded rows never count: :func:`trainkit.core.totals.per_row`), reduced
exactly by :mod:`trainkit.core.totals` (masked sums and counts, divided once at the end).

>>> import numpy as np
>>> list(get_metrics(["accuracy", "mae"]))
['accuracy', 'mae']
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from trainkit.core.totals import BatchMetric, LossAverage, MetricFn, Weighted, WeightedAverage  # noqa: F401
from trainkit.core.tree import PyTree
from trainkit.objective import crossentropy, losses, metric_states
from trainkit.objective.keras_metrics import (  # noqa: F401
    F1Score,
    FBetaScore,
    IoU,
    MeanIoU,
    PrecisionAtRecall,
    RecallAtPrecision,
    SensitivityAtSpecificity,
    SpecificityAtSensitivity,
)
from trainkit.objective.metric_states import AUC, Precision, R2Score, Recall, RootMeanSquaredError  # noqa: F401


def _class_predictions(predictions: jax.Array) -> jax.Array:
    return jnp.argmax(predictions, axis=-1)


def sparse_categorical_accuracy(predictions: jax.Array, labels: jax.Array) -> jax.Array:
    """1.0 where the arg-max of the logits equals the integer label (``(B,)`` or ``(B, 1)``)."""
    return (_class_predictions(predictions) == losses.sparse_labels(predictions, labels)).astype(jnp.float32)


def categorical_accuracy(predictions: jax.Array, one_hot: jax.Array) -> jax.Array:
    """1.0 where the arg-max of the logits equals the arg-max of the one-hot target."""
    return (_class_predictions(predictions) == _class_predictions(one_hot)).astype(jnp.float32)


def binary_accuracy(logits: jax.Array, labels: jax.Array, threshold: float = 0.0) -> jax.Array:
    """1.0 where ``logits > threshold`` (0: logits; 0.5 for probabilities) agrees with
    ``labels > 0.5``."""
    labels = losses._match_targets(logits, labels)
    return ((logits > threshold) == (labels > 0.5)).astype(jnp.float32)


def accuracy(predictions: jax.Array, targets: jax.Array, threshold: float = 0.0) -> jax.Array:
    """Keras's ``"accuracy"``: sparse, categorical or binary (at ``threshold``), chosen from the
    shapes."""
    sparse = targets.ndim == predictions.ndim - 1 or (targets.ndim == predictions.ndim and targets.shape[-1] == 1)
    if sparse and predictions.shape[-1] > 1:
        return sparse_categorical_accuracy(predictions, targets)
    if targets.shape == predictions.shape and predictions.shape[-1] > 1:
        return categorical_accuracy(predictions, targets)
    return binary_accuracy(predictions, targets, threshold)


def _at_threshold(fn: Callable[..., jax.Array], logits: bool) -> MetricFn:
    if logits:
        return fn
    at_half = functools.partial(fn, threshold=0.5)
    functools.update_wrapper(at_half, fn)
    return at_half


def top_k_accuracy(k: int = 5) -> MetricFn:
    """1.0 where the integer label is among the ``k`` largest logits.

    >>> import jax.numpy as jnp
    >>> top_k_accuracy(2)(jnp.array([[0.1, 0.5, 0.4]]), jnp.array([2])).tolist()
    [1.0]
    """

    def top_k(predictions: jax.Array, labels: jax.Array) -> jax.Array:
        labels = losses.sparse_labels(predictions, labels)
        _, best = jax.lax.top_k(predictions, min(k, predictions.shape[-1]))  # k >= classes: always in
        return jnp.any(best == labels[..., None], axis=-1).astype(jnp.float32)

    top_k.__name__ = f"top_{k}_accuracy" if k != 5 else "top_k_accuracy"
    return top_k


def cosine_similarity(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    """The cosine of the angle between prediction and target (Keras's metric; the loss is its
    negative)."""
    return -losses.cosine_similarity(predictions, targets)


def top_k_categorical_accuracy(predictions: jax.Array, one_hot: jax.Array) -> jax.Array:
    """1.0 where the class of the one-hot target is among the 5 largest outputs."""
    return top_k_accuracy(5)(predictions, jnp.argmax(one_hot, axis=-1))


METRICS: dict[str, MetricFn] = {
    "accuracy": accuracy,
    "acc": accuracy,
    "sparse_categorical_accuracy": sparse_categorical_accuracy,
    "categorical_accuracy": categorical_accuracy,
    "binary_accuracy": binary_accuracy,
    "top_k_accuracy": top_k_accuracy(5),
    "sparse_top_k_categorical_accuracy": top_k_accuracy(5),
    "top_k_categorical_accuracy": top_k_categorical_accuracy,
    "mse": losses.mean_squared_error,
    "mean_squared_error": losses.mean_squared_error,
    "mae": losses.mean_absolute_error,
    "mean_absolute_error": losses.mean_absolute_error,
    "mape": losses.mean_absolute_percentage_error,
    "mean_absolute_percentage_error": losses.mean_absolute_percentage_error,
    "msle": losses.mean_squared_logarithmic_error,
    "mean_squared_logarithmic_error": losses.mean_squared_logarithmic_error,
    "cosine_similarity": cosine_similarity,
    "log_cosh": losses.log_cosh,
    "logcosh": losses.log_cosh,
    "log_cosh_error": losses.log_cosh,  # Keras 3's metric name (keras.metrics.LogCoshError)
    "hinge": losses.hinge,
    "squared_hinge": losses.squared_hinge,
    "categorical_hinge": losses.categorical_hinge,
    "poisson": losses.poisson,
    "kl_divergence": losses.kl_divergence,
}


# Names whose function depends on whether the output holds logits (trainkit's convention for
# names) or probabilities (the output's loss says from_logits=False, as Keras's default).
def _stateful(cls: type, logits: bool) -> MetricFn:
    """A stateful metric (AUC, precision, ...) reading logits or probabilities."""
    fn: MetricFn = cls().with_space(logits)
    return fn


SPACE_METRICS: dict[str, Callable[[bool], MetricFn]] = {
    "accuracy": lambda logits: _at_threshold(accuracy, logits),
    "acc": lambda logits: _at_threshold(accuracy, logits),
    "binary_accuracy": lambda logits: _at_threshold(binary_accuracy, logits),
    **{
        kind: functools.partial(crossentropy.named, kind)
        for kind in ("binary_crossentropy", "categorical_crossentropy", "sparse_categorical_crossentropy")
    },
    **{name: functools.partial(_stateful, cls) for name, cls in metric_states.STATEFUL.items()},
}


def known_names() -> list[str]:
    return sorted({*METRICS, *SPACE_METRICS})


#: Known metrics that improve upwards (Keras's ``_direction = "up"``); every other known one down.
RISING = ("acc", "auc", "AUC", "precision", "recall", "r2_score", "cosine_similarity")


def direction(name: str, metric: object = None) -> str | None:
    """``"max"`` or ``"min"`` for a metric known by this name or a metric object that declares
    it (Keras's ``_direction``), ``None`` for a user's own (whose direction only its author
    knows, as in Keras).

    >>> direction("val_accuracy".removeprefix("val_")), direction("mae"), direction("my_score")
    ('max', 'min', None)
    >>> direction("my_f1", F1Score(average="macro"))
    'max'
    """
    if isinstance(metric, metric_states.StatefulMetric) and metric.direction is not None:
        return metric.direction
    if name not in METRICS and name not in SPACE_METRICS:
        return None
    return "max" if any(part in name for part in RISING) else "min"


def get_metrics(metrics: Sequence[object] | None, *, logits: bool = True) -> dict[str, MetricFn]:
    """Named per-example metric functions (or :mod:`trainkit.objective.metric_states` objects) for an
    output of logits (``logits=True``) or probabilities, from names, metric objects and callables (anything
    else refused); unknown names list the known ones."""
    resolved: dict[str, MetricFn] = {}
    for metric in metrics or ():
        if type(metric).__module__.startswith("keras") and hasattr(metric, "update_state"):
            raise TypeError(
                f"{type(metric).__name__} is a stateful Keras metric object, which cannot run inside trainkit's "
                "compiled step. Pass its name (e.g. 'accuracy'), or a function of (predictions, targets), or one "
                "whose parameters are named (y_true, y_pred), which is called Keras's way."
            )
        if isinstance(metric, str):
            if metric in SPACE_METRICS:
                name, fn = metric, SPACE_METRICS[metric](logits)
            elif metric in METRICS:
                name, fn = metric, METRICS[metric]
            else:
                raise ValueError(
                    f"Unknown metric {metric!r}. Known names: {', '.join(known_names())}; "
                    "or pass a callable metric(predictions, targets) returning per-example values."
                )
        elif isinstance(metric, metric_states.StatefulMetric):
            name, fn = metric.__name__, metric.with_space(logits)
        elif callable(metric):
            fn = losses.in_keras_order(metric)  # fn(y_true, y_pred) is called Keras's way
            name = getattr(metric, "__name__", None) or type(metric).__name__
            if isinstance(metric, functools.partial):
                name = getattr(metric.func, "__name__", "metric")
        else:
            raise TypeError(
                f"A metric must be a name or a callable; received {metric!r} of type {type(metric).__name__}."
            )
        if name == "loss" or name in resolved:
            raise ValueError(f"Two metrics are named {name!r}; give each a distinct __name__.")
        resolved[name] = OfOneOutput(name, fn) if isinstance(metric, str) and not isinstance(fn, BatchMetric) else fn
    return resolved


class OfOneOutput:
    """A metric by name, which reads one output: given a dict or tuple of them (a model of several
    outputs whose metrics name none), it says how to name the one it reads, when traced.

    >>> OfOneOutput("accuracy", METRICS["accuracy"])({"logits": 0, "features": 0}, None)
    Traceback (most recent call last):
    ValueError: metrics=['accuracy'] reads one output, but the predictions are a dict of ['features', 'logits']: ...
    """

    def __init__(self, name: str, fn: MetricFn):
        self.__name__, self.fn = name, fn

    def __call__(self, predictions: PyTree, targets: PyTree) -> jax.Array:
        if isinstance(predictions, (dict, list, tuple)):
            kind = f"dict of {sorted(map(str, predictions))}" if isinstance(predictions, dict) else (
                f"{type(predictions).__name__} of {len(predictions)}"
            )  # fmt: skip
            raise ValueError(
                f"metrics=[{self.__name__!r}] reads one output, but the predictions are a {kind}: return the one "
                "it reads as compute_loss's predictions (loss, (outputs['logits'], model_state)), or give the "
                "targets the outputs' structure and name it, metrics={'logits': [...]} (Keras's form)."
            )
        return self.fn(predictions, targets)


class LossTerm(BatchMetric):
    """The (unweighted by ``loss_weights``) loss of one output of a multi-output model, logged as
    Keras logs it (``<output>_loss``), reduced like the loss."""

    def __init__(self, row_loss: MetricFn, name: str):
        self.row_loss, self.__name__ = row_loss, name

    def batch_state(self, predictions, targets, *, mask, weights):
        values = jnp.asarray(self.row_loss(predictions, targets), jnp.float32)
        return LossAverage(total=jnp.where(mask > 0, values * weights, 0.0).sum(), count=mask.sum())


def all_metrics(metrics, weighted_metrics, *, logits: bool = True) -> dict[str, MetricFn]:
    """``metrics`` (unweighted) then ``weighted_metrics`` (as :class:`Weighted`), named as Keras
    names them: a weighted metric whose name is taken becomes ``weighted_<name>``.

    >>> list(all_metrics(["mae"], ["mae", "mse"]))
    ['mae', 'weighted_mae', 'mse']
    """
    resolved = get_metrics(metrics, logits=logits)
    for name, fn in get_metrics(weighted_metrics, logits=logits).items():
        resolved[f"weighted_{name}" if name in resolved else name] = Weighted(fn)
    return resolved
