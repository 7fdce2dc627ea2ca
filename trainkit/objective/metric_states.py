"""Metrics that are not a mean of per-row values: AUC, precision, recall (confusion counts at
thresholds), root mean squared error and R^2, computed as Keras 3 computes them.

Each batch gives a *state* of a few sums (a ``clu.metrics.Metric``). States are summed across
devices and batches like the averages of :mod:`trainkit.objective.metrics`, with padded rows at weight
0, and the value is computed once from the totals: exact on any device count and any split of
the data into batches.

A stateful metric is an object with ``batch_state(predictions, targets, *, mask, weights)``;
``mask`` holds the row weights it counts with (the real rows, or the sample weights for a
``weighted_metrics=`` entry) and ``weights`` the sample weights.

>>> import numpy as np
>>> auc = AUC(from_logits=False)
>>> state = auc.batch_state(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1]), mask=np.ones(4), weights=None)
>>> round(float(state.compute()), 3)
0.75
"""

from __future__ import annotations

from typing import Any

import clu.metrics
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from trainkit.core.totals import BatchMetric

EPSILON = 1e-7


def _divide_no_nan(a, b):
    safe = jnp.where(b == 0, 1.0, b)
    return jnp.where(b == 0, 0.0, a / safe)


@flax.struct.dataclass
class Sums(clu.metrics.Metric):
    """A state whose fields are sums: merged by adding, field by field."""

    def merge(self, other):
        return jax.tree.map(jnp.add, self, other)


@flax.struct.dataclass
class ConfusionCounts(Sums):
    """Weighted true/false positives/negatives at each threshold (arrays of shape ``(T,)``)."""

    tp: jax.Array
    fp: jax.Array
    tn: jax.Array
    fn: jax.Array

    @classmethod
    def count(cls, probabilities, labels, row_weights, thresholds) -> ConfusionCounts:
        """Every element of a row counts with the row's weight; a label is positive when non-zero."""
        rows = probabilities.shape[0]
        scores = jnp.asarray(probabilities, jnp.float32).reshape(rows, -1)
        truth = (jnp.asarray(labels).reshape(rows, -1) != 0)[..., None]
        weight = jnp.broadcast_to(jnp.asarray(row_weights, jnp.float32)[:, None], scores.shape)[..., None]
        predicted = scores[..., None] > jnp.asarray(thresholds, jnp.float32)
        total = lambda flags: jnp.where(flags, weight, 0.0).sum(axis=(0, 1))  # noqa: E731
        return cls(
            tp=total(truth & predicted),
            fp=total(~truth & predicted),
            tn=total(~truth & ~predicted),
            fn=total(truth & ~predicted),
        )


@flax.struct.dataclass
class AucCounts(ConfusionCounts):
    def compute(self):
        """The area under the ROC curve by Keras's interpolation (trapezoids between thresholds)."""
        recall = _divide_no_nan(self.tp, self.tp + self.fn)
        fp_rate = _divide_no_nan(self.fp, self.fp + self.tn)
        heights = (recall[:-1] + recall[1:]) / 2.0
        return jnp.sum((fp_rate[:-1] - fp_rate[1:]) * heights)


@flax.struct.dataclass
class PrecisionCounts(ConfusionCounts):
    def compute(self):
        return _divide_no_nan(self.tp, self.tp + self.fp)[0]


@flax.struct.dataclass
class RecallCounts(ConfusionCounts):
    def compute(self):
        return _divide_no_nan(self.tp, self.tp + self.fn)[0]


@flax.struct.dataclass
class RootMeanSquare(Sums):
    total: jax.Array
    count: jax.Array

    def compute(self):
        return jnp.sqrt(_divide_no_nan(self.total, self.count))


@flax.struct.dataclass
class R2Sums(Sums):
    """Per target column: weighted sums of y, y^2 and the squared residual, and the weight."""

    sum: jax.Array
    squared_sum: jax.Array
    residual: jax.Array
    count: jax.Array

    def compute(self):
        mean = self.sum / self.count
        total = self.squared_sum - self.sum * mean
        scores = 1.0 - self.residual / total
        return jnp.mean(jnp.where(jnp.isinf(scores), 0.0, scores))


class StatefulMetric(BatchMetric):
    """Base class: a metric whose batch state is not a per-row mean. Subclasses set ``__name__``
    and implement :meth:`batch_state`; ``from_logits`` says whether outputs are logits (``None``:
    follow the output's loss, as trainkit decides for names). ``direction``: ``"max"`` or
    ``"min"`` when the metric improves one way (Keras's ``_direction``), for ``EarlyStopping``
    and ``ModelCheckpoint`` under any name."""

    direction: str | None = "max"

    def __init__(self, name: str, from_logits: bool | None = None):
        self.__name__ = name
        self.from_logits = from_logits

    def with_space(self, logits: bool) -> StatefulMetric:
        """This metric for an output of logits (``True``) or of probabilities."""
        if self.from_logits is not None:
            return self
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__, from_logits=logits)
        return copy

    def _probabilities(self, predictions):
        predictions = jnp.asarray(predictions, jnp.float32)
        return jax.nn.sigmoid(predictions) if self.from_logits else predictions

    def batch_state(self, predictions, targets, *, mask, weights) -> clu.metrics.Metric:
        raise NotImplementedError

    def __call__(self, predictions, targets):  # the value of one batch (for tests and debugging)
        rows = jnp.shape(predictions)[0]
        return self.batch_state(predictions, targets, mask=jnp.ones(rows), weights=None).compute()


class AUC(StatefulMetric):
    """Keras's ``AUC()``: the ROC area from confusion counts at ``num_thresholds`` evenly spaced
    thresholds, every output element a binary decision (multi-label outputs flattened)."""

    def __init__(self, num_thresholds: int = 200, from_logits: bool | None = None, name: str = "auc"):
        super().__init__(name, from_logits)
        if num_thresholds <= 1:
            raise ValueError(f"num_thresholds must be > 1; received {num_thresholds}.")
        inner = [(i + 1) / (num_thresholds - 1) for i in range(num_thresholds - 2)]
        self.thresholds = np.array([0.0 - EPSILON, *inner, 1.0 + EPSILON], np.float32)

    def batch_state(self, predictions, targets, *, mask, weights):
        scores = jnp.clip(self._probabilities(predictions), 0.0, 1.0)  # as Keras's evenly spaced thresholds do
        return AucCounts.count(scores, targets, mask, self.thresholds)


class Precision(StatefulMetric):
    """Keras's ``Precision()``: true positives / predicted positives at ``threshold``."""

    counts = PrecisionCounts

    def __init__(self, threshold: float = 0.5, from_logits: bool | None = None, name: str = "precision"):
        super().__init__(name, from_logits)
        self.thresholds = np.array([threshold], np.float32)

    def batch_state(self, predictions, targets, *, mask, weights):
        return self.counts.count(self._probabilities(predictions), targets, mask, self.thresholds)


class Recall(Precision):
    """Keras's ``Recall()``: true positives / actual positives at ``threshold``."""

    counts = RecallCounts

    def __init__(self, threshold: float = 0.5, from_logits: bool | None = None, name: str = "recall"):
        super().__init__(threshold, from_logits, name)


def _columns(predictions, targets):
    predictions = jnp.asarray(predictions, jnp.float32)
    rows = predictions.shape[0]
    return predictions.reshape(rows, -1), jnp.asarray(targets, jnp.float32).reshape(rows, -1)


class RootMeanSquaredError(StatefulMetric):
    """``sqrt`` of the mean squared error over all rows (not the mean of per-batch roots)."""

    direction = "min"

    def __init__(self, name: str = "root_mean_squared_error"):
        super().__init__(name, from_logits=False)

    def batch_state(self, predictions, targets, *, mask, weights):
        predictions, targets = _columns(predictions, targets)
        per_row = jnp.mean((predictions - targets) ** 2, axis=1)
        mask = jnp.asarray(mask, jnp.float32)
        return RootMeanSquare(total=jnp.where(mask > 0, per_row * mask, 0.0).sum(), count=mask.sum())


class R2Score(StatefulMetric):
    """Keras's ``R2Score()`` (``class_aggregation="uniform_average"``): the coefficient of
    determination per target column, averaged over the columns."""

    def __init__(self, name: str = "r2_score"):
        super().__init__(name, from_logits=False)

    def batch_state(self, predictions, targets, *, mask, weights):
        predictions, targets = _columns(predictions, targets)
        w = jnp.broadcast_to(jnp.asarray(mask, jnp.float32)[:, None], targets.shape)
        targets = jnp.where(w > 0, targets, 0.0)
        residual = jnp.where(w > 0, (targets - predictions) ** 2 * w, 0.0)
        return R2Sums(
            sum=(targets * w).sum(axis=0),
            squared_sum=(targets * targets * w).sum(axis=0),
            residual=residual.sum(axis=0),
            count=w.sum(axis=0),
        )


STATEFUL: dict[str, Any] = {
    "auc": AUC,
    "AUC": AUC,
    "precision": Precision,
    "recall": Recall,
    "root_mean_squared_error": RootMeanSquaredError,
    "r2_score": R2Score,
}
