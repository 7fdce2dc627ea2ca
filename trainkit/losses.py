"""Loss functions by name, and per-example evaluation of any loss.

A loss is ``loss(predictions, targets)`` in optax's argument order, returning per-example
values (shape ``(batch, ...)``) or a scalar mean. Built-in names expect *logits* for the
cross-entropies, as Flax models usually output them.

>>> import jax.numpy as jnp
>>> loss = get_loss("mse")
>>> per_example(loss)(jnp.array([[1.0], [3.0]]), jnp.array([0.0, 1.0])).tolist()
[1.0, 4.0]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

LossFn = Callable[[Any, Any], jax.Array]


def _match_targets(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    """``(B,)`` targets against ``(B, 1)`` predictions are expanded, never broadcast to (B, B)."""
    if targets.ndim == predictions.ndim - 1 and predictions.shape[-1] == 1:
        return targets[..., None]
    return targets


def _mean_over_features(values: jax.Array) -> jax.Array:
    return values.reshape(values.shape[0], -1).mean(axis=1) if values.ndim > 1 else values


def sparse_labels(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Integer labels ``(B, ..., 1)`` squeezed to ``(B, ...)`` against logits ``(B, ..., C)``, as
    Keras accepts them."""
    if labels.ndim == logits.ndim and labels.shape[-1] == 1:
        return labels[..., 0]
    return labels


def sparse_categorical_crossentropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Softmax cross-entropy of logits ``(B, ..., C)`` against integer labels ``(B, ...)`` (or
    ``(B, ..., 1)``)."""
    labels = sparse_labels(logits, labels)
    return _mean_over_features(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def categorical_crossentropy(logits: jax.Array, one_hot: jax.Array) -> jax.Array:
    """Softmax cross-entropy of logits against one-hot (or soft) targets."""
    return _mean_over_features(optax.softmax_cross_entropy(logits, one_hot))


def binary_crossentropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Sigmoid cross-entropy of logits against 0/1 targets, averaged over features."""
    labels = _match_targets(logits, labels).astype(logits.dtype)
    return _mean_over_features(optax.sigmoid_binary_cross_entropy(logits, labels))


def mean_squared_error(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    """Squared error averaged over features."""
    return _mean_over_features(jnp.square(predictions - _match_targets(predictions, targets)))


def mean_absolute_error(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    """Absolute error averaged over features."""
    return _mean_over_features(jnp.abs(predictions - _match_targets(predictions, targets)))


LOSSES: dict[str, LossFn] = {
    "sparse_categorical_crossentropy": sparse_categorical_crossentropy,
    "categorical_crossentropy": categorical_crossentropy,
    "binary_crossentropy": binary_crossentropy,
    "mse": mean_squared_error,
    "mean_squared_error": mean_squared_error,
    "mae": mean_absolute_error,
    "mean_absolute_error": mean_absolute_error,
}

# Losses whose targets must be integer class ids.
SPARSE_LOSSES = (sparse_categorical_crossentropy, optax.softmax_cross_entropy_with_integer_labels)


def get_loss(loss: str | LossFn) -> LossFn:
    """A loss function from a name or a callable; unknown names list the known ones."""
    if callable(loss):
        return loss
    if isinstance(loss, str) and loss in LOSSES:
        return LOSSES[loss]
    raise ValueError(
        f"Unknown loss {loss!r}. Known names: {', '.join(sorted(LOSSES))}; or pass a callable "
        "loss(predictions, targets) such as optax.softmax_cross_entropy_with_integer_labels."
    )


def per_example(loss: LossFn) -> LossFn:
    """Wraps ``loss`` so that it returns one value per example.

    Per-example outputs ``(B, ...)`` are averaged over their non-batch axes. A loss that
    reduces the batch to a scalar is re-evaluated row by row (``jax.vmap`` over batches of
    one), which is exact for losses that are a mean over rows; the choice is made at trace
    time and costs nothing per step.
    """

    def values(predictions, targets):
        out = jnp.asarray(loss(predictions, targets))
        if out.ndim == 0:
            one_row = lambda p, t: loss(  # noqa: E731
                jax.tree.map(lambda a: a[None], p), jax.tree.map(lambda a: a[None], t)
            )
            out = jax.vmap(one_row)(predictions, targets)
        return _mean_over_features(out)

    return values


def check_targets(loss: LossFn, targets: Any) -> None:
    """Raises before compiling when a sparse (integer-label) loss receives float labels."""
    if loss not in SPARSE_LOSSES or targets is None:
        return
    for leaf in jax.tree.leaves(targets):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(
                f"The loss {getattr(loss, '__name__', loss)} needs integer class ids as labels, "
                f"but the labels have dtype {dtype}. Convert them with y.astype('int32'), or use "
                "loss='categorical_crossentropy' for one-hot or soft targets."
            )
