"""Cross-entropies (plain and focal) on logits or on probabilities, as Keras 3 computes them,
and the loss objects that carry ``from_logits`` (``tk.losses.BinaryCrossentropy(...)`` and
friends, named and defaulted as Keras's classes).

Per-example values, in trainkit's ``(predictions, targets)`` order. With probabilities the
outputs are clipped to ``[1e-7, 1 - 1e-7]`` (categorical ones renormalised first) exactly as
Keras does; with logits the log-sum-exp forms are used.

>>> import jax.numpy as jnp
>>> probs, labels = jnp.array([[0.2, 0.8]]), jnp.array([1])
>>> round(float(sparse_categorical(probs, labels, from_logits=False)[0]), 4)
0.2231
>>> round(float(SparseCategoricalCrossentropy()(probs, labels)[0]), 4)   # Keras's default: probabilities
0.2231
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

EPSILON = 1e-7


def align(predictions, targets):
    """``(B,)`` targets against ``(B, 1)`` outputs are expanded, never broadcast to ``(B, B)``."""
    predictions, targets = jnp.asarray(predictions), jnp.asarray(targets)
    if targets.ndim == predictions.ndim - 1 and predictions.shape[-1] == 1:
        targets = targets[..., None]
    return predictions, targets.astype(predictions.dtype)


def _log_probabilities(predictions, from_logits: bool):
    if from_logits:
        return jax.nn.log_softmax(predictions, axis=-1)
    predictions = predictions / jnp.sum(predictions, axis=-1, keepdims=True)
    return jnp.log(jnp.clip(predictions, EPSILON, 1.0 - EPSILON))


def _smooth(one_hot, label_smoothing: float, classes: int | float):
    return one_hot if not label_smoothing else one_hot * (1.0 - label_smoothing) + label_smoothing / classes


def categorical(predictions, one_hot, *, from_logits: bool = True, label_smoothing: float = 0.0):
    """``-sum(t * log p)`` over the last axis."""
    predictions, one_hot = align(predictions, one_hot)
    one_hot = _smooth(one_hot, label_smoothing, predictions.shape[-1])
    return -jnp.sum(one_hot * _log_probabilities(predictions, from_logits), axis=-1)


def sparse_categorical(predictions, labels, *, from_logits: bool = True, ignore_class: int | None = None):
    """Categorical cross-entropy against integer labels ``(B, ...)`` or ``(B, ..., 1)``; the labels of
    ``ignore_class`` read as class 0 (a finite value: the step gives their tokens no weight)."""
    predictions, labels = jnp.asarray(predictions), jnp.asarray(labels)
    if labels.ndim == predictions.ndim and labels.shape[-1] == 1:
        labels = labels[..., 0]
    if ignore_class is not None:
        labels = jnp.where(labels == ignore_class, 0, labels)
    log_p = _log_probabilities(predictions, from_logits)
    return -jnp.take_along_axis(log_p, labels.astype(jnp.int32)[..., None], axis=-1)[..., 0]


def _binary_terms(predictions, targets, from_logits: bool):
    if from_logits:
        return -(targets * jax.nn.log_sigmoid(predictions) + (1.0 - targets) * jax.nn.log_sigmoid(-predictions))
    p = jnp.clip(predictions, EPSILON, 1.0 - EPSILON)
    return -(targets * jnp.log(p) + (1.0 - targets) * jnp.log(1.0 - p))


def binary(predictions, targets, *, from_logits: bool = True, label_smoothing: float = 0.0):
    """Sigmoid cross-entropy averaged over the last axis."""
    predictions, targets = align(predictions, targets)
    targets = _smooth(targets, label_smoothing, 2.0)
    return jnp.mean(_binary_terms(predictions, targets, from_logits), axis=-1)


def binary_focal(
    predictions,
    targets,
    *,
    from_logits: bool = True,
    gamma: float = 2.0,
    alpha: float = 0.25,
    apply_class_balancing: bool = False,
    label_smoothing: float = 0.0,
):
    """Keras's ``binary_focal_crossentropy``: ``(1 - p_t)^gamma * bce``, averaged over the last axis."""
    predictions, targets = align(predictions, targets)
    targets = _smooth(targets, label_smoothing, 2.0)
    p = jax.nn.sigmoid(predictions) if from_logits else predictions
    bce = _binary_terms(p, targets, from_logits=False)
    p_t = targets * p + (1.0 - targets) * (1.0 - p)
    focal = (1.0 - p_t) ** gamma * bce
    if apply_class_balancing:
        focal = (targets * alpha + (1.0 - targets) * (1.0 - alpha)) * focal
    return jnp.mean(focal, axis=-1)


def categorical_focal(
    predictions,
    one_hot,
    *,
    from_logits: bool = True,
    gamma: float = 2.0,
    alpha: float = 0.25,
    label_smoothing: float = 0.0,
):
    """Keras's ``categorical_focal_crossentropy``: ``-sum(alpha (1 - p)^gamma t log p)``."""
    predictions, one_hot = align(predictions, one_hot)
    one_hot = _smooth(one_hot, label_smoothing, predictions.shape[-1])
    p = jax.nn.softmax(predictions, axis=-1) if from_logits else predictions
    p = jnp.clip(p / jnp.sum(p, axis=-1, keepdims=True), EPSILON, 1.0 - EPSILON)
    return jnp.sum(alpha * (1.0 - p) ** gamma * -one_hot * jnp.log(p), axis=-1)


class Loss:
    """A loss object: ``loss(predictions, targets)`` -> per-example values, with a ``name`` (for
    the logs) and ``from_logits`` (whether it reads the outputs as logits: metrics given by name
    for the same output follow it, e.g. ``"accuracy"`` thresholds at 0.5 on probabilities).
    Subclasses set ``fn``, a per-example function taking ``from_logits`` and the options."""

    fn: staticmethod[..., jax.Array]

    def __init__(self, name: str, from_logits: bool, **options):
        self.name = self.__name__ = name
        self.from_logits = bool(from_logits)
        self.options = options

    def __call__(self, predictions, targets):
        return type(self).fn(predictions, targets, from_logits=self.from_logits, **self.options)

    def __repr__(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}(from_logits={self.from_logits}{options})"


class SparseCategoricalCrossentropy(Loss):
    """Keras's class: probabilities by default; ``from_logits=True`` for logits. ``ignore_class``:
    targets of that class (padding) count in no loss, and a batch's loss is the mean over its other
    tokens, as Keras reduces it (the step weighs the tokens: :func:`trainkit.core.step_helpers.with_ignored_tokens`)."""

    fn = staticmethod(sparse_categorical)

    def __init__(
        self, from_logits: bool = False, ignore_class: int | None = None, name: str = "sparse_categorical_crossentropy"
    ):
        if ignore_class is not None and (isinstance(ignore_class, bool) or not isinstance(ignore_class, int)):
            raise ValueError(f"ignore_class is a class id (an int) or None; received {ignore_class!r}.")
        super().__init__(name, from_logits, **({} if ignore_class is None else {"ignore_class": ignore_class}))
        self.ignore_class = ignore_class


class CategoricalCrossentropy(Loss):
    fn = staticmethod(categorical)

    def __init__(self, from_logits: bool = False, label_smoothing: float = 0.0, name: str = "categorical_crossentropy"):
        super().__init__(name, from_logits, label_smoothing=float(label_smoothing))


class BinaryCrossentropy(Loss):
    fn = staticmethod(binary)

    def __init__(self, from_logits: bool = False, label_smoothing: float = 0.0, name: str = "binary_crossentropy"):
        super().__init__(name, from_logits, label_smoothing=float(label_smoothing))


class BinaryFocalCrossentropy(Loss):
    fn = staticmethod(binary_focal)

    def __init__(
        self,
        apply_class_balancing: bool = False,
        alpha: float = 0.25,
        gamma: float = 2.0,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        name: str = "binary_focal_crossentropy",
    ):
        super().__init__(
            name,
            from_logits,
            apply_class_balancing=apply_class_balancing,
            alpha=alpha,
            gamma=gamma,
            label_smoothing=label_smoothing,
        )


class CategoricalFocalCrossentropy(Loss):
    fn = staticmethod(categorical_focal)

    def __init__(
        self,
        alpha: float = 0.25,
        gamma: float = 2.0,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        name: str = "categorical_focal_crossentropy",
    ):
        super().__init__(name, from_logits, alpha=alpha, gamma=gamma, label_smoothing=label_smoothing)


def named(kind: str, from_logits: bool):
    """The per-example cross-entropy named ``kind`` (a Keras name) for logits or probabilities."""
    functions: dict[str, Callable[..., jax.Array]] = {
        "sparse_categorical_crossentropy": sparse_categorical,
        "categorical_crossentropy": categorical,
        "binary_crossentropy": binary,
        "binary_focal_crossentropy": binary_focal,
        "categorical_focal_crossentropy": categorical_focal,
    }
    fn = functions[kind]

    def crossentropy(predictions, targets):
        return fn(predictions, targets, from_logits=from_logits)

    crossentropy.__name__ = kind
    return crossentropy
