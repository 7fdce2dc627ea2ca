"""Keras 3's F-scores, IoUs and constrained confusion metrics, from exact totals.

Like :mod:`trainkit.objective.metric_states`, each batch gives a state of sums (summed over
devices and batches, padded rows at weight 0) and the value is computed once from the totals,
as Keras computes it from its accumulated variables:

- ``FBetaScore`` / ``F1Score``: per-class true and false positives and false negatives;
- ``IoU`` / ``MeanIoU``: the confusion matrix;
- ``PrecisionAtRecall``, ``RecallAtPrecision``, ``SensitivityAtSpecificity``,
  ``SpecificityAtSensitivity``: confusion counts at evenly spaced thresholds, the best value
  under the constraint.

>>> import numpy as np
>>> f1 = F1Score(average="macro", from_logits=False)
>>> labels, scores = np.eye(3)[[0, 1, 2, 2]], np.eye(3)[[0, 1, 1, 2]]
>>> round(float(f1(scores, labels)), 4)
0.7778
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from trainkit.objective.metric_states import ConfusionCounts, StatefulMetric, Sums, _divide_no_nan

#: Keras's ``backend.epsilon()``, which its F-scores add to every denominator.
KERAS_EPSILON = 1e-7
AVERAGES = ("micro", "macro", "weighted")


@flax.struct.dataclass
class FScoreCounts(Sums):
    """Weighted true positives, false positives, false negatives and true instances per class
    (one total each for ``average="micro"``); ``beta`` and ``average`` are static."""

    tp: jax.Array
    fp: jax.Array
    fn: jax.Array
    support: jax.Array
    beta: float = flax.struct.field(pytree_node=False, default=1.0)
    average: str = flax.struct.field(pytree_node=False, default="macro")

    def compute(self):
        precision = self.tp / (self.tp + self.fp + KERAS_EPSILON)
        recall = self.tp / (self.tp + self.fn + KERAS_EPSILON)
        b2 = self.beta**2
        score = precision * recall / (b2 * precision + recall + KERAS_EPSILON) * (1 + b2)
        if self.average == "weighted":
            return jnp.sum(score * self.support / (jnp.sum(self.support) + KERAS_EPSILON))
        return jnp.mean(score)


class FBetaScore(StatefulMetric):
    """Keras's ``FBetaScore(average, beta, threshold)``: the weighted harmonic mean of
    precision and recall per class, averaged ``"micro"`` (global counts), ``"macro"`` or
    ``"weighted"`` (by support). ``threshold=None`` counts each row's arg-max class as
    predicted; a threshold counts every output above it (multi-label; logits go through a
    sigmoid first, as for ``Precision``). Targets are one-hot (Keras) or class ids.

    Keras's default ``average=None`` returns one score per class; trainkit logs one number per
    metric, so pass an average (docs/keras_differences.md).
    """

    def __init__(
        self,
        average: str | None = None,
        beta: float = 1.0,
        threshold: float | None = None,
        from_logits: bool | None = None,
        name: str = "fbeta_score",
    ):
        super().__init__(name, from_logits)
        if average not in AVERAGES:
            raise ValueError(
                f"{type(self).__name__}(average={average!r}): trainkit logs one number per metric, and Keras's "
                "average=None gives one per class. Pass average='macro' (the mean over classes), 'micro' (global "
                "counts) or 'weighted' (by each class's support)."
            )
        if beta <= 0:
            raise ValueError(f"beta must be > 0; received {beta}.")
        if threshold is not None and not 0 < threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1] or None; received {threshold}.")
        self.average, self.beta, self.threshold = average, float(beta), threshold

    def _predicted(self, predictions):
        predictions = jnp.asarray(predictions, jnp.float32)
        if self.threshold is not None:
            return self._probabilities(predictions) > self.threshold
        scores = jax.nn.softmax(predictions, axis=-1) if self.from_logits else predictions
        return (scores >= jnp.max(scores, axis=-1, keepdims=True)) & (jnp.abs(scores) > 1e-9)  # as Keras

    def batch_state(self, predictions, targets, *, mask, weights):
        predicted = self._predicted(predictions).astype(jnp.float32)
        truth = _one_hot_like(targets, predicted)
        rows = jnp.asarray(mask, jnp.float32)[:, None]
        axis = None if self.average == "micro" else 0
        total = lambda values: jnp.sum(values * rows, axis=axis)  # noqa: E731
        return FScoreCounts(
            tp=total(predicted * truth),
            fp=total(predicted * (1 - truth)),
            fn=total((1 - predicted) * truth),
            support=total(truth),
            beta=self.beta,
            average=self.average,
        )


class F1Score(FBetaScore):
    """Keras's ``F1Score(average, threshold)``: :class:`FBetaScore` with ``beta=1``."""

    def __init__(
        self,
        average: str | None = None,
        threshold: float | None = None,
        from_logits: bool | None = None,
        name: str = "f1_score",
    ):
        super().__init__(average, 1.0, threshold, from_logits, name)


def _one_hot_like(targets, predicted):
    """Targets as one-hot rows of ``predicted``'s classes (class ids are expanded)."""
    targets = jnp.asarray(targets)
    if targets.shape == predicted.shape:
        return targets.astype(jnp.float32)
    ids = targets.reshape(predicted.shape[:-1]).astype(jnp.int32)
    return jax.nn.one_hot(ids, predicted.shape[-1], dtype=jnp.float32)


@flax.struct.dataclass
class ConfusionMatrix(Sums):
    """The weighted confusion matrix (true class x predicted class) and the classes averaged."""

    matrix: jax.Array
    targets: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())

    def compute(self):
        predicted, actual = jnp.sum(self.matrix, axis=0), jnp.sum(self.matrix, axis=1)
        hits = jnp.diagonal(self.matrix)
        union = (predicted + actual - hits)[jnp.asarray(self.targets)]
        valid = jnp.sum((union != 0).astype(jnp.float32))
        return _divide_no_nan(jnp.sum(_divide_no_nan(hits[jnp.asarray(self.targets)], union)), valid)


class IoU(StatefulMetric):
    """Keras's ``IoU(num_classes, target_class_ids)``: intersection over union of the classes
    in ``target_class_ids`` from the confusion matrix of all elements, averaged over those with
    a non-empty union. As in Keras, targets and predictions are class ids unless
    ``sparse_y_true`` / ``sparse_y_pred`` is ``False`` (then the arg-max over ``axis``), and
    ``ignore_class`` drops the elements of that target class (and class ids outside
    ``[0, num_classes)`` are dropped). Keras accumulates an IoU in integers by default, so its
    float sample weights are truncated (it warns); trainkit's are not."""

    def __init__(
        self,
        num_classes: int,
        target_class_ids: Sequence[int],
        name: str = "io_u",  # Keras's name for it
        ignore_class: int | None = None,
        sparse_y_true: bool = True,
        sparse_y_pred: bool = True,
        axis: int = -1,
    ):
        super().__init__(name, from_logits=False)
        if max(target_class_ids, default=-1) >= num_classes or min(target_class_ids, default=0) < 0:
            raise ValueError(f"target_class_ids {list(target_class_ids)} must lie in [0, {num_classes}).")
        self.num_classes, self.targets = int(num_classes), tuple(int(i) for i in target_class_ids)
        self.ignore_class, self.sparse_y_true, self.sparse_y_pred, self.axis = (
            ignore_class,
            sparse_y_true,
            sparse_y_pred,
            axis,
        )

    def batch_state(self, predictions, targets, *, mask, weights):
        predictions, targets = jnp.asarray(predictions), jnp.asarray(targets)
        if not self.sparse_y_pred:
            predictions = jnp.argmax(predictions, axis=self.axis)
        if not self.sparse_y_true:
            targets = jnp.argmax(targets, axis=self.axis)
        rows = predictions.shape[0]
        predicted = predictions.reshape(rows, -1).astype(jnp.int32)
        actual = targets.reshape(rows, -1).astype(jnp.int32)
        weight = jnp.broadcast_to(jnp.asarray(mask, jnp.float32)[:, None], actual.shape)
        inside = (actual >= 0) & (actual < self.num_classes) & (predicted >= 0) & (predicted < self.num_classes)
        if self.ignore_class is not None:
            inside = inside & (actual != self.ignore_class)
        weight = jnp.where(inside, weight, 0.0)  # as Keras: class ids out of range never count
        actual, predicted = jnp.where(inside, actual, 0), jnp.where(inside, predicted, 0)
        index = (actual * self.num_classes + predicted).reshape(-1)
        counts = jnp.zeros(self.num_classes**2, jnp.float32).at[index].add(weight.reshape(-1), mode="drop")
        return ConfusionMatrix(counts.reshape(self.num_classes, self.num_classes), self.targets)


class MeanIoU(IoU):
    """Keras's ``MeanIoU(num_classes)``: :class:`IoU` over every class."""

    def __init__(
        self,
        num_classes: int,
        name: str = "mean_io_u",  # Keras's name for it
        ignore_class: int | None = None,
        sparse_y_true: bool = True,
        sparse_y_pred: bool = True,
        axis: int = -1,
    ):
        super().__init__(num_classes, range(num_classes), name, ignore_class, sparse_y_true, sparse_y_pred, axis)


@flax.struct.dataclass
class ConstrainedCounts(ConfusionCounts):
    """Confusion counts at thresholds, and which rate must reach ``value`` (the constraint) for
    which to be maximised (``kind``: ``"precision_at_recall"`` ...)."""

    kind: str = flax.struct.field(pytree_node=False, default="precision_at_recall")
    value: float = flax.struct.field(pytree_node=False, default=0.5)

    def compute(self):
        rates = {
            "recall": _divide_no_nan(self.tp, self.tp + self.fn),  # sensitivity
            "precision": _divide_no_nan(self.tp, self.tp + self.fp),
            "specificity": _divide_no_nan(self.tn, self.tn + self.fp),
        }
        rates["sensitivity"] = rates["recall"]
        dependent, constrained = self.kind.split("_at_")
        feasible = rates[constrained] >= self.value
        return jnp.max(jnp.where(feasible, rates[dependent], 0.0), initial=0.0)


class _AtConstraint(StatefulMetric):
    """The best ``dependent`` rate among the thresholds where the ``constrained`` rate reaches
    ``value`` (0 where none does), Keras's ``SensitivitySpecificityBase``: ``num_thresholds``
    evenly spaced in [0, 1] (one: 0.5); ``class_id`` reads one output column (of one-hot targets, or
    the rows of that class id)."""

    kind = ""

    def __init__(
        self,
        value: float,
        num_thresholds: int = 200,
        class_id: int | None = None,
        name: str | None = None,
        from_logits: bool | None = None,
    ):
        constrained = self.kind.split("_at_")[1]
        super().__init__(name or self.kind, from_logits)
        if not 0 <= value <= 1:
            raise ValueError(f"{constrained} must be in [0, 1]; received {value}.")
        if num_thresholds <= 0:
            raise ValueError(f"num_thresholds must be an integer > 0; received {num_thresholds}.")
        inner = [(i + 1) / (num_thresholds - 1) for i in range(num_thresholds - 2)]
        self.thresholds = np.array([0.5] if num_thresholds == 1 else [0.0, *inner, 1.0], np.float32)
        self.value, self.class_id = float(value), class_id

    def batch_state(self, predictions, targets, *, mask, weights):
        predictions, targets = jnp.asarray(predictions), jnp.asarray(targets)
        if self.class_id is not None:
            sparse = targets.ndim < predictions.ndim or targets.shape[-1] != predictions.shape[-1]
            targets = (
                (targets.reshape(predictions.shape[:-1]) == self.class_id) if sparse else targets[..., self.class_id]
            )
            predictions = predictions[..., self.class_id]
        scores = jnp.clip(self._probabilities(predictions), 0.0, 1.0)  # as Keras's evenly spaced buckets
        counts = ConfusionCounts.count(scores, targets, mask, self.thresholds)
        return ConstrainedCounts(counts.tp, counts.fp, counts.tn, counts.fn, kind=self.kind, value=self.value)


class PrecisionAtRecall(_AtConstraint):
    """Keras's ``PrecisionAtRecall(recall)``: the best precision where recall >= ``recall``."""

    kind = "precision_at_recall"


class RecallAtPrecision(_AtConstraint):
    """Keras's ``RecallAtPrecision(precision)``: the best recall where precision >= ``precision``."""

    kind = "recall_at_precision"


class SensitivityAtSpecificity(_AtConstraint):
    """Keras's ``SensitivityAtSpecificity(specificity)``."""

    kind = "sensitivity_at_specificity"


class SpecificityAtSensitivity(_AtConstraint):
    """Keras's ``SpecificityAtSensitivity(sensitivity)``."""

    kind = "specificity_at_sensitivity"
