"""Per-batch metric functions (used inside the step) and their exact masked reduction.

A metric is ``metric(predictions, targets) -> per-example values`` (or a scalar mean). Inside
a step each metric becomes a :class:`WeightedAverage` (a ``clu.metrics.Average`` whose count is
the sum of the row weights, so padded rows with weight 0 never count). Totals and counts are
summed across devices and steps, and divided once at the end: the result does not depend on the
device count or on how the data was split into batches.

>>> import numpy as np
>>> a = WeightedAverage.from_values(np.array([1.0, 3.0, 100.0]), np.array([1.0, 1.0, 0.0]))
>>> float(a.merge(WeightedAverage.from_values(np.array([5.0]), np.array([1.0]))).compute())
3.0
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import clu.metrics
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from trainkit import crossentropy, losses, metric_states
from trainkit.metric_states import AUC, Precision, R2Score, Recall, RootMeanSquaredError  # noqa: F401

MetricFn = Callable[[Any, Any], jax.Array]


@flax.struct.dataclass
class WeightedAverage(clu.metrics.Average):
    """``clu.metrics.Average`` with real-valued row weights (sample weights times the mask)."""

    @classmethod
    def empty(cls) -> WeightedAverage:
        return cls(total=jnp.array(0, jnp.float32), count=jnp.array(0, jnp.float32))

    @classmethod
    def from_values(cls, values: jax.Array, weights: jax.Array) -> WeightedAverage:
        """``total = sum(values * weights)`` (rows of weight 0 are dropped even if not finite)."""
        xp = jnp if isinstance(values, jax.Array) else np
        weighted = xp.where(weights > 0, values * weights, 0)
        return cls(total=weighted.sum(), count=weights.sum())


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


def _at_threshold(fn: MetricFn, logits: bool) -> MetricFn:
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
    "hinge": losses.hinge,
    "squared_hinge": losses.squared_hinge,
    "categorical_hinge": losses.categorical_hinge,
    "poisson": losses.poisson,
    "kl_divergence": losses.kl_divergence,
}


# Names whose function depends on whether the output holds logits (trainkit's convention for
# names) or probabilities (the output's loss says from_logits=False, as Keras's default).
SPACE_METRICS: dict[str, Callable[[bool], MetricFn]] = {
    "accuracy": lambda logits: _at_threshold(accuracy, logits),
    "acc": lambda logits: _at_threshold(accuracy, logits),
    "binary_accuracy": lambda logits: _at_threshold(binary_accuracy, logits),
    **{
        kind: functools.partial(crossentropy.named, kind)
        for kind in ("binary_crossentropy", "categorical_crossentropy", "sparse_categorical_crossentropy")
    },
    **{name: (lambda logits, cls=cls: cls().with_space(logits)) for name, cls in metric_states.STATEFUL.items()},
}


def known_names() -> list[str]:
    return sorted({*METRICS, *SPACE_METRICS})


def get_metrics(metrics: Sequence[str | MetricFn] | None, *, logits: bool = True) -> dict[str, MetricFn]:
    """Named per-example metric functions (or :mod:`trainkit.metric_states` objects) for an
    output of logits (``logits=True``) or probabilities; unknown names list the known ones."""
    resolved: dict[str, MetricFn] = {}
    for metric in metrics or ():
        if type(metric).__module__.startswith("keras") and hasattr(metric, "update_state"):
            raise TypeError(
                f"{type(metric).__name__} is a stateful Keras metric object, which cannot run inside trainkit's "
                "compiled step. Pass its name (e.g. 'accuracy'), or a function of (predictions, targets); a "
                "function written for Keras's (y_true, y_pred) order goes through tk.losses.keras_order(fn)."
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
            fn = metric
            name = getattr(metric, "__name__", None) or type(metric).__name__
            if isinstance(metric, functools.partial):
                name = getattr(metric.func, "__name__", "metric")
        else:
            raise TypeError(
                f"A metric must be a name or a callable; received {metric!r} of type {type(metric).__name__}."
            )
        if name == "loss" or name in resolved:
            raise ValueError(f"Two metrics are named {name!r}; give each a distinct __name__.")
        resolved[name] = fn
    return resolved


class Weighted:
    """A metric that the sample weights apply to (Keras's ``weighted_metrics=``); metrics given
    as ``metrics=`` count every real row once, whatever its sample weight."""

    weighted = True

    def __init__(self, fn: MetricFn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, predictions, targets):
        return self.fn(predictions, targets)


@flax.struct.dataclass
class LossAverage(WeightedAverage):
    """A loss: ``sum(loss * sample_weight)`` over the real rows, divided by the number of real
    rows (Keras's ``sum_over_batch_size``); NaN when no row counted."""


class LossTerm:
    """The (unweighted by ``loss_weights``) loss of one output of a multi-output model, logged as
    Keras logs it (``<output>_loss``), reduced like the loss."""

    weighted = False

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


def batch_state(fn: MetricFn, predictions, targets, *, mask, weights) -> clu.metrics.Metric:
    """One batch's state of the metric ``fn``: a :class:`WeightedAverage` of its per-row values
    (rows counted by ``weights`` for a :class:`Weighted` metric, else once each), or the state a
    stateful metric builds itself."""
    inner = fn.fn if isinstance(fn, Weighted) else fn
    if hasattr(inner, "batch_state"):
        counted = weights if isinstance(fn, Weighted) else mask
        return inner.batch_state(predictions, targets, mask=counted, weights=weights)
    values = jnp.asarray(fn(predictions, targets), jnp.float32)
    rows = mask.shape[0]
    values = jnp.broadcast_to(values, (rows,)) if values.ndim == 0 else values.reshape(rows, -1).mean(axis=1)
    return WeightedAverage.from_values(values, weights if getattr(fn, "weighted", False) else mask)


def compute(totals: dict[str, clu.metrics.Metric], order: Sequence[str] = ("loss",)) -> dict[str, float]:
    """Python floats ``total / count`` for each metric (a ``WeightedAverage`` or a
    ``clu.metrics.LastValue``), the names in ``order`` first (pytrees sort dict keys; logs keep
    the user's order); names starting with ``_`` are trainkit's own probes, not logged. Where
    nothing was counted, a metric is 0.0 (Keras's ``divide_no_nan``, e.g. all sample weights
    zero) and the loss is NaN (a skipped fp16 step is not an observation).

    >>> compute({"loss": WeightedAverage.empty(), "mae": WeightedAverage.empty()})
    {'loss': nan, 'mae': 0.0}
    """
    names = [n for n in order if n in totals] + [n for n in totals if n not in order and not n.startswith("_")]

    def value(name):
        metric = totals[name]
        if not isinstance(metric, (WeightedAverage, clu.metrics.LastValue)):
            return float(metric.compute())  # a stateful metric's totals
        if float(metric.count):
            return float(metric.total / metric.count)
        return float("nan") if name == "loss" or isinstance(metric, LossAverage) else 0.0

    return {name: value(name) for name in names}


def merge(a: dict[str, clu.metrics.Metric] | None, b: dict[str, clu.metrics.Metric]):
    """Merges two dicts of averages (``a`` may be ``None``); runs once per step on the host,
    so averages are added directly (clu's ``merge`` checks shapes first, at 5x the cost)."""
    if a is None:
        return b

    def one(left, right):
        if isinstance(left, WeightedAverage) and type(left) is type(right):
            return type(left)(total=left.total + right.total, count=left.count + right.count)
        return left.merge(right)

    return {k: one(a[k], b[k]) for k in b}


def merge_stacked(totals: dict[str, clu.metrics.Metric] | None, stacked: dict[str, clu.metrics.Metric], steps: int):
    """Merges the host metrics of ``steps`` steps stacked on a leading axis (one fused call):
    averages summed over the axis, the last value kept, any other metric merged step by step.

    >>> stacked = {"loss": LossAverage(total=np.array([1.0, 3.0]), count=np.array([2.0, 2.0]))}
    >>> compute(merge_stacked(None, stacked, 2), ("loss",))
    {'loss': 1.0}
    """
    merged = {}
    for name, metric in stacked.items():
        if isinstance(metric, WeightedAverage):
            merged[name] = type(metric)(total=metric.total.sum(0), count=metric.count.sum(0))
        elif isinstance(metric, clu.metrics.LastValue):
            merged[name] = jax.tree.map(lambda a: a[-1], metric)
        else:
            for index in range(steps):
                step = jax.tree.map(lambda a, i=index: a[i], metric)
                merged[name] = step if index == 0 else merged[name].merge(step)
    return merge(totals, merged)
