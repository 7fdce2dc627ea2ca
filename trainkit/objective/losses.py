"""Loss functions by name, and per-example evaluation of any loss.

A loss is ``loss(predictions, targets)`` in optax's argument order, returning per-example
values (shape ``(batch, ...)``; one that returns the batch's mean is evaluated row by row:
:func:`trainkit.core.totals.per_row`). Built-in names expect *logits* for the
cross-entropies, as Flax models usually output them. Keras's order ``fn(y_true, y_pred)`` is
taken from a Keras loss object (``keras.losses.SparseCategoricalCrossentropy(from_logits=False)``,
JAX backend), a function whose parameters are named ``y_true, y_pred``, or one wrapped in
:func:`keras_order`.

>>> import jax.numpy as jnp
>>> loss = get_loss("mse")
>>> per_example(loss)(jnp.array([[1.0], [3.0]]), jnp.array([0.0, 1.0])).tolist()
[1.0, 4.0]
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from trainkit.core.step_helpers import weighed_by_tokens
from trainkit.core.totals import per_row
from trainkit.core.tree import PyTree, Shape
from trainkit.objective import crossentropy
from trainkit.objective.crossentropy import (  # noqa: F401  (Keras's loss classes, as tk.losses.*)
    BinaryCrossentropy,
    BinaryFocalCrossentropy,
    CategoricalCrossentropy,
    CategoricalFocalCrossentropy,
    Loss,
    SparseCategoricalCrossentropy,
)

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


def pick_crossentropy(target_shape: Shape, output_shape: Shape) -> LossFn:
    """Keras's ``"crossentropy"`` rule (``compile_utils.is_binary_or_sparse_categorical``), on
    shapes with the batch axis: one output is binary; targets of lower rank, or with one
    feature against several outputs, are class ids; otherwise one-hot.

    >>> pick_crossentropy((8,), (8, 10)).__name__, pick_crossentropy((8, 10), (8, 10)).__name__
    ('sparse_categorical_crossentropy', 'categorical_crossentropy')
    """
    if len(output_shape) < 2 or output_shape[-1] == 1:
        return binary_crossentropy
    if len(target_shape) < len(output_shape) or target_shape[-1] == 1:
        return sparse_categorical_crossentropy
    return categorical_crossentropy


def crossentropy_by_shapes(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Keras's ``loss="crossentropy"`` (or ``"ce"``) on logits: the binary, sparse or categorical
    cross-entropy that the shapes call for (:func:`pick_crossentropy`), chosen when tracing."""
    return pick_crossentropy(targets.shape, logits.shape)(logits, targets)


def mean_squared_error(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    """Squared error averaged over features."""
    return _mean_over_features(jnp.square(predictions - _match_targets(predictions, targets)))


def mean_absolute_error(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    """Absolute error averaged over features."""
    return _mean_over_features(jnp.abs(predictions - _match_targets(predictions, targets)))


# Keras's other losses, per example (the mean or sum over the last axis, as Keras computes them),
# in trainkit's (predictions, targets) order. EPSILON is Keras's backend.epsilon().
EPSILON = 1e-7


def huber(predictions: jax.Array, targets: jax.Array, delta: float = 1.0) -> jax.Array:
    """Quadratic for errors up to ``delta``, linear beyond (Keras's ``huber``)."""
    predictions, targets = crossentropy.align(predictions, targets)
    error = jnp.abs(predictions - targets)
    return jnp.mean(jnp.where(error <= delta, 0.5 * error**2, delta * error - 0.5 * delta**2), axis=-1)


def log_cosh(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    """``log(cosh(error))`` averaged over the last axis, computed stably."""
    predictions, targets = crossentropy.align(predictions, targets)
    x = predictions - targets
    return jnp.mean(x + jax.nn.softplus(-2.0 * x) - jnp.log(2.0), axis=-1)


def mean_absolute_percentage_error(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    predictions, targets = crossentropy.align(predictions, targets)
    return 100.0 * jnp.mean(jnp.abs((targets - predictions) / jnp.maximum(jnp.abs(targets), EPSILON)), axis=-1)


def mean_squared_logarithmic_error(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    predictions, targets = crossentropy.align(predictions, targets)
    first = jnp.log(jnp.maximum(predictions, EPSILON) + 1.0)
    second = jnp.log(jnp.maximum(targets, EPSILON) + 1.0)
    return jnp.mean((first - second) ** 2, axis=-1)


def cosine_similarity(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    """Minus the cosine of the angle between prediction and target (Keras's loss sign)."""
    predictions, targets = crossentropy.align(predictions, targets)
    unit = lambda v: v * jax.lax.rsqrt(jnp.maximum(jnp.sum(v * v, axis=-1, keepdims=True), 1e-12))  # noqa: E731
    return -jnp.sum(unit(targets) * unit(predictions), axis=-1)


def kl_divergence(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    """``sum(t * log(t / p))`` with both clipped to ``[1e-7, 1]`` (probabilities, as Keras)."""
    predictions, targets = crossentropy.align(predictions, targets)
    targets, predictions = jnp.clip(targets, EPSILON, 1.0), jnp.clip(predictions, EPSILON, 1.0)
    return jnp.sum(targets * jnp.log(targets / predictions), axis=-1)


def poisson(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    predictions, targets = crossentropy.align(predictions, targets)
    return jnp.mean(predictions - targets * jnp.log(predictions + EPSILON), axis=-1)


def _hinge_labels(targets: jax.Array) -> jax.Array:
    """Labels in {0, 1} become {-1, 1} (all of them, or none: Keras's rule)."""
    binary = jnp.all((targets == 0) | (targets == 1))
    return jnp.where(binary, 2.0 * targets - 1.0, targets)


def hinge(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    predictions, targets = crossentropy.align(predictions, targets)
    return jnp.mean(jnp.maximum(1.0 - _hinge_labels(targets) * predictions, 0.0), axis=-1)


def squared_hinge(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    predictions, targets = crossentropy.align(predictions, targets)
    return jnp.mean(jnp.maximum(1.0 - _hinge_labels(targets) * predictions, 0.0) ** 2, axis=-1)


def categorical_hinge(predictions: jax.Array, one_hot: jax.Array) -> jax.Array:
    predictions, one_hot = crossentropy.align(predictions, one_hot)
    positive = jnp.sum(one_hot * predictions, axis=-1)
    negative = jnp.max((1.0 - one_hot) * predictions, axis=-1)
    return jnp.maximum(negative - positive + 1.0, 0.0)


binary_focal_crossentropy = crossentropy.named("binary_focal_crossentropy", from_logits=True)
categorical_focal_crossentropy = crossentropy.named("categorical_focal_crossentropy", from_logits=True)

LOSSES: dict[str, LossFn] = {
    "crossentropy": crossentropy_by_shapes,
    "ce": crossentropy_by_shapes,
    "sparse_categorical_crossentropy": sparse_categorical_crossentropy,
    "categorical_crossentropy": categorical_crossentropy,
    "binary_crossentropy": binary_crossentropy,
    "mse": mean_squared_error,
    "mean_squared_error": mean_squared_error,
    "mae": mean_absolute_error,
    "mean_absolute_error": mean_absolute_error,
    "huber": huber,
    "log_cosh": log_cosh,
    "logcosh": log_cosh,
    "mape": mean_absolute_percentage_error,
    "mean_absolute_percentage_error": mean_absolute_percentage_error,
    "msle": mean_squared_logarithmic_error,
    "mean_squared_logarithmic_error": mean_squared_logarithmic_error,
    "cosine_similarity": cosine_similarity,
    "kl_divergence": kl_divergence,
    "kld": kl_divergence,
    "poisson": poisson,
    "hinge": hinge,
    "squared_hinge": squared_hinge,
    "categorical_hinge": categorical_hinge,
    "binary_focal_crossentropy": binary_focal_crossentropy,
    "categorical_focal_crossentropy": categorical_focal_crossentropy,
}

# Losses whose targets must be integer class ids.
SPARSE_LOSSES = (sparse_categorical_crossentropy, optax.softmax_cross_entropy_with_integer_labels)


# Losses that take logits: trainkit warns once when a model feeds them probabilities.
LOGITS_LOSSES = (
    sparse_categorical_crossentropy,
    categorical_crossentropy,
    binary_crossentropy,
    crossentropy_by_shapes,
    optax.softmax_cross_entropy_with_integer_labels,
    optax.softmax_cross_entropy,
    optax.sigmoid_binary_cross_entropy,
    binary_focal_crossentropy,
    categorical_focal_crossentropy,
)


def keras_order(fn: Callable[[PyTree, PyTree], jax.Array]) -> LossFn:
    """A loss or metric written for Keras, ``fn(y_true, y_pred)``, in trainkit's (optax's)
    order ``(predictions, targets)``.

    >>> import jax.numpy as jnp
    >>> mae = keras_order(lambda y_true, y_pred: jnp.abs(y_true - y_pred).mean(axis=-1))
    >>> mae.__name__, mae(jnp.array([[3.0]]), jnp.array([[1.0]])).tolist()
    ('<lambda>', [2.0])
    """

    def swapped(predictions, targets):
        return fn(targets, predictions)

    swapped.__name__ = getattr(fn, "__name__", None) or getattr(fn, "name", None) or type(fn).__name__
    return swapped


def in_keras_order(fn: LossFn) -> LossFn:
    """``fn`` called the way its parameters are named: ``fn(y_true, y_pred)`` (Keras's names)
    gets the targets first (through :func:`keras_order`); any other callable keeps trainkit's
    (optax's) order ``(predictions, targets)``.

    >>> import jax.numpy as jnp
    >>> signed = in_keras_order(lambda y_true, y_pred: y_pred - y_true)  # written for Keras
    >>> float(signed(jnp.array(3.0), jnp.array(1.0)))  # predictions 3, targets 1
    2.0
    """
    try:
        names = [p.name for p in inspect.signature(fn).parameters.values()][:2]
    except (TypeError, ValueError):  # a builtin without a signature
        return fn
    return keras_order(fn) if names == ["y_true", "y_pred"] else fn


def is_keras_object(obj: object) -> bool:
    """A Keras loss (or metric) object, called ``call(y_true, y_pred)``."""
    return type(obj).__module__.startswith("keras") and hasattr(obj, "call")


def ignored_class(loss: object) -> int | None:
    """The class a loss ignores (Keras's ``ignore_class``: trainkit's or a Keras loss object's), ``None``: none.

    >>> ignored_class(crossentropy.SparseCategoricalCrossentropy(ignore_class=0)), ignored_class("mse")
    (0, None)
    """
    if isinstance(loss, crossentropy.SparseCategoricalCrossentropy):
        return loss.ignore_class
    if is_keras_object(loss):
        ignore = cast(_Configured, loss).get_config().get("ignore_class")
        return int(ignore) if isinstance(ignore, int) else None
    return None


class _Configured(Protocol):
    """A Keras loss object, as far as :func:`ignored_class` reads it."""

    def get_config(self) -> dict[str, object]: ...


def _from_keras_loss(loss: Any) -> LossFn:
    """A Keras loss object's unreduced ``call(y_true, y_pred)``; trainkit applies the mask, the
    sample weights and Keras's ``sum_over_batch_size`` reduction itself."""
    import keras

    if keras.backend.backend() != "jax":
        raise ValueError(
            f"A Keras loss object ({type(loss).__name__}) runs inside trainkit's JAX step only with Keras's JAX "
            f"backend; this Keras uses {keras.backend.backend()!r}. Set KERAS_BACKEND=jax before importing keras."
        )
    fn = keras_order(loss.call)
    fn.__name__ = getattr(loss, "name", None) or type(loss).__name__
    return fn


def get_loss(loss: str | LossFn) -> LossFn:
    """A loss function from a name, a callable ``(predictions, targets)`` (or ``(y_true,
    y_pred)``, called Keras's way), or a Keras loss object; unknown names list the known ones."""
    if is_keras_object(loss):
        return _from_keras_loss(loss)
    if callable(loss):
        return in_keras_order(loss)
    if isinstance(loss, str) and loss in LOSSES:
        return LOSSES[loss]
    raise ValueError(
        f"Unknown loss {loss!r}. Known names: {', '.join(sorted(LOSSES))}; or pass a callable "
        "loss(predictions, targets) such as optax.softmax_cross_entropy_with_integer_labels."
    )


def per_example(loss: LossFn, per_token: jax.Array | None = None, what: str = "The loss") -> LossFn:
    """Wraps ``loss`` so that it returns one value per example.

    Per-example outputs ``(B, ...)`` are averaged over their non-batch axes (``per_token``: each
    element weighed by its sample weight first, the shapes checked, ``what`` naming the loss). A loss
    that reduces the batch to a scalar is re-evaluated row by row (``jax.vmap`` over batches of
    one), which is exact for losses that are a mean over rows; the choice is made at trace
    time and costs nothing per step.
    """

    def values(predictions, targets):
        if per_token is None:
            return _mean_over_features(per_row(loss, predictions, targets))
        tokens = tuple(per_token.shape)  # (rows, T, ...): the loss evaluated per token, as rows of their own
        for name, part in (("outputs", predictions), ("targets", targets)):
            for leaf in jax.tree.leaves(part):
                if tuple(jnp.shape(leaf)[: len(tokens)]) != tokens:
                    raise ValueError(
                        f"{what}: sample_weight is per token, shape {tokens}, and the {name} have shape "
                        f"{jnp.shape(leaf)}, which does not lead with it: give a weight per row (shape "
                        f"({tokens[0]},)), or per token of the {name}' leading axes."
                    )
        flat = lambda a: jnp.reshape(a, (-1, *jnp.shape(a)[len(tokens) :]))  # noqa: E731
        elements = per_row(loss, jax.tree.map(flat, predictions), jax.tree.map(flat, targets))
        return _mean_over_features(weighed_by_tokens(jnp.reshape(elements, tokens), per_token, what))

    return values


def concrete(loss: LossFn, target_shape: Shape, output_shape: Shape) -> LossFn:
    """``loss`` itself, or for ``"crossentropy"`` the one it picks for these shapes (with the
    batch axis), so that checks see the loss that will run."""
    return pick_crossentropy(target_shape, output_shape) if loss is crossentropy_by_shapes else loss


def reading_probabilities(loss: LossFn, outputs: PyTree = None) -> str:
    """The loss object that reads probabilities in place of a logits ``loss`` (Keras's
    ``from_logits=False``), as a user writes it; ``"crossentropy"`` by the ``outputs``' shape."""
    if loss is crossentropy_by_shapes:
        if outputs is not None and pick_crossentropy((), np.shape(outputs)) is binary_crossentropy:
            return "tk.losses.BinaryCrossentropy()"
        return "tk.losses.SparseCategoricalCrossentropy() (class ids) or CategoricalCrossentropy() (one-hot)"
    if loss in (sparse_categorical_crossentropy, optax.softmax_cross_entropy_with_integer_labels):
        return "tk.losses.SparseCategoricalCrossentropy()"
    if loss in (binary_crossentropy, optax.sigmoid_binary_cross_entropy, binary_focal_crossentropy):
        return "tk.losses.BinaryCrossentropy()"
    return "tk.losses.CategoricalCrossentropy()"


def looks_like_probabilities(outputs: jax.Array, targets: PyTree = None) -> jax.Array:
    """1.0 for each row whose outputs look like probabilities rather than logits: non-negative
    and summing to 1 (several classes), or inside ``[0, 1]`` (one output). Only the first
    position of each row is read (a sequence model's first token), so the check stays cheap.

    >>> looks_like_probabilities(jnp.array([[0.2, 0.8], [2.0, -1.0]])).tolist()
    [1.0, 0.0]
    """
    xp = np if isinstance(outputs, np.ndarray) else jnp  # host values: NumPy, no device op
    outputs = xp.asarray(outputs)
    if outputs.ndim == 1:
        outputs = outputs[:, None]
    first = outputs.reshape(outputs.shape[0], -1, outputs.shape[-1])[:, 0, :].astype(xp.float32)
    if first.shape[-1] == 1:
        flags = (first >= 0) & (first <= 1)
    else:
        flags = (first >= 0) & (xp.abs(first.sum(axis=-1, keepdims=True) - 1) < 1e-3)
    looks: jax.Array = xp.all(flags, axis=1).astype(xp.float32)
    return looks


def is_sparse(loss: object) -> bool:
    """Whether ``loss`` takes integer class ids against per-class outputs."""
    return loss in SPARSE_LOSSES or isinstance(loss, crossentropy.SparseCategoricalCrossentropy)


# Named losses that compare targets and outputs element by element (same per-example shape).
ELEMENTWISE_LOSSES = tuple(fn for fn in LOSSES.values() if fn not in SPARSE_LOSSES and fn is not crossentropy_by_shapes)


def check_targets(loss: LossFn, targets: PyTree) -> None:
    """Raises before compiling when a sparse (integer-label) loss receives float labels."""
    if not is_sparse(loss) or targets is None:
        return
    for leaf in jax.tree.leaves(targets):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(
                f"The loss {getattr(loss, '__name__', loss)} needs integer class ids as labels, "
                f"but the labels have dtype {dtype}. Convert them with y.astype('int32'), or use "
                "loss='categorical_crossentropy' for one-hot or soft targets."
            )
