"""The pure reductions a step of the user's own needs to mean the same on every strategy, each
told the device axis it runs under (``None`` under ``jit``, whose batch is global): the
masked, weighted mean over the global batch, one normal draw per global row, the global batch's
rows. :class:`~trainkit.core.step_state.StepState` binds them to the step being traced
(``state.mean``, ``state.normal``, ``state.all_rows``); :class:`~trainkit.core.watched_batch.WatchedBatch`
binds :func:`normal` and :func:`all_rows` for a ``compute_loss`` (``batch.normal``).

>>> import jax.numpy as jnp
>>> batch = {"mask": jnp.array([1.0, 1.0, 0.0])}
>>> float(mean(jnp.array([1.0, 3.0, 100.0]), batch, None))   # the padded row left out
2.0
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from trainkit.core.state import Batch
from trainkit.core.tree import PyTree


def row_weights(batch: Batch) -> jax.Array:
    """Each row's weight: ``mask * sample_weight`` (padded rows 0); per-token weights weigh the
    loss's values inside each row (:func:`token_weights`), so then each real row counts once."""
    mask = batch["mask"]
    weights = dict.get(batch, "sample_weight")  # not noted as read (a WatchedBatch)
    if weights is None or jnp.ndim(weights) > 1:
        whole: jax.Array = mask
        return whole
    weighted: jax.Array = mask * weights
    return weighted


def token_weights(batch: Batch) -> jax.Array | None:
    """The batch's per-token sample weights, ``(rows, T, ...)`` (``None``: one weight per row, or none):
    each weighs its element of a row's loss before the row's mean, as Keras weights timesteps."""
    weights = dict.get(batch, "sample_weight")  # not noted as read (a WatchedBatch)
    return weights if weights is not None and jnp.ndim(weights) > 1 else None


def weighed_by_tokens(values: jax.Array, tokens: jax.Array, what: str) -> jax.Array:
    """Per-element loss ``values`` times their per-token ``tokens`` weights (an element of weight 0
    is 0, even if not finite: padding); raises, naming ``what``, where their shapes differ.

    >>> weighed_by_tokens(jnp.array([[1.0, jnp.nan]]), jnp.array([[2.0, 0.0]]), "the loss").tolist()
    [[2.0, 0.0]]
    """
    if jnp.shape(values) != jnp.shape(tokens):
        rows = jnp.shape(tokens)[0]
        raise ValueError(
            f"{what} has shape {jnp.shape(values)} and sample_weight, per token, {jnp.shape(tokens)}: a per-token "
            f"weight weighs the loss element at its place, so they need the same shape. Return the loss per token "
            f"(shape {jnp.shape(tokens)}); or let the built-in loss weigh its tokens, self.objective.loss(predictions, "
            f"batch['y'], batch.get('sample_weight')) (read so, trainkit weighs nothing again); or give one weight "
            f"per row (shape ({rows},))."
        )
    weighed: jax.Array = jnp.where(tokens > 0, values * tokens, 0.0)
    return weighed


def with_ignored_tokens(batch: Batch, valid: jax.Array, axis: str | None) -> Batch:
    """``batch`` whose ``sample_weight`` says which tokens count, as Keras's ``ignore_class`` does: each of
    the ``valid`` tokens (``(rows, T, ...)``, 1 where the target is not the ignored class) of a real row
    weighs ``real rows * tokens per row / valid tokens`` of the global batch (times its sample weight,
    per row or per token), the others 0, so the per-token mean over a batch's rows is the mean over its
    valid tokens (Keras's masked ``sum_over_batch_size``); the counts summed over ``axis``.

    >>> batch = {"mask": jnp.array([1.0, 1.0, 0.0])}
    >>> valid = jnp.array([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])   # the third row pads
    >>> with_ignored_tokens(batch, valid, None)["sample_weight"].tolist()  # 2 rows x 2 tokens / 3 valid
    [[1.3333333730697632, 0.0], [1.3333333730697632, 1.3333333730697632], [0.0, 0.0]]
    """
    mask = batch["mask"]
    valid = valid.astype(jnp.float32) * mask.reshape((-1,) + (1,) * (valid.ndim - 1))  # padded rows: none
    count, real = valid.sum(), mask.sum()
    if axis is not None:
        count, real = jax.lax.psum(count, axis), jax.lax.psum(real, axis)
    tokens = valid.size // valid.shape[0]
    weights = dict.get(batch, "sample_weight")
    if weights is None:
        weights = jnp.ones_like(valid)
    elif jnp.ndim(weights) == 1:
        weights = jnp.reshape(weights, (-1,) + (1,) * (valid.ndim - 1))
    elif jnp.shape(weights) != valid.shape:
        raise ValueError(
            f"sample_weight, per token, has shape {jnp.shape(weights)} and the targets the ignored class is read "
            f"from {valid.shape}: give one weight per token of the targets, or one per row."
        )
    return {**batch, "sample_weight": weights * valid * (real * tokens / jnp.maximum(count, 1.0))}


def refuse_token_weights(batch: Batch, what: str) -> None:
    """Raises, naming ``what`` and the fix, where ``batch`` carries per-token weights a per-row reduction
    would drop without a word."""
    weights = token_weights(batch)
    if weights is not None:
        raise ValueError(
            f"{what} weighs rows, and this batch's sample_weight is per token (shape {jnp.shape(weights)}): it "
            "would be dropped. Multiply your per-token values by batch['sample_weight'] and reduce each row "
            "yourself, then pass the rows' mask alone: state.mean(row_values, {'mask': batch['mask']})."
        )


def weighted_total(row_values: jax.Array, mask: jax.Array, weights: jax.Array) -> jax.Array:
    """``sum(values * weights)`` over the real rows (padded rows dropped, even if NaN)."""
    return jnp.where(mask > 0, row_values * weights, 0).sum()


def _per_row(values: jax.Array, rows: int) -> jax.Array:
    values = jnp.asarray(values)
    if values.ndim == 0 or values.shape[0] != rows:
        raise ValueError(
            f"state.mean takes one value per row of the batch (shape ({rows}, ...)); received shape {values.shape}. "
            "Compute the value per row (no jnp.mean over the batch) and let state.mean(values, batch) reduce it."
        )
    return values.astype(jnp.float32).reshape(rows, -1).mean(axis=1)


def mean(values: jax.Array, batch: Batch, axis: str | None) -> jax.Array:
    """The mean of per-row ``values`` over the real rows of the global batch, each weighted by its
    ``sample_weight`` (Keras's loss reduction): padded rows left out, even if NaN. ``values`` has
    this device's rows (the batch's) or, from :func:`all_rows`, the global batch's. Under a
    device axis its value is the global mean and its gradient ``devices`` times this device's share
    of it (of the global batch's: the gradient itself), so that the gradients averaged over the axis
    (``apply_gradients``, as pmap's data parallelism averages per-device means) are exactly the
    single-device gradient: a ``jnp.mean`` over the batch gives it too wherever no row pads."""
    refuse_token_weights(batch, "state.mean")
    mask = batch["mask"]
    rows, weights = mask.shape[0], row_weights(batch)
    devices = 1 if axis is None else jax.lax.axis_size(axis)
    if devices > 1 and jnp.shape(values)[:1] == (rows * devices,):
        mask, weights = all_rows(mask, axis), all_rows(weights, axis)  # the global batch's: reduced on every device
        whole: jax.Array = weighted_total(_per_row(values, mask.shape[0]), mask, weights) / jnp.maximum(mask.sum(), 1.0)
        return whole  # the same on every device, and so its gradient: averaged over the axis, itself
    local = weighted_total(_per_row(values, rows), mask, weights)
    if axis is None:
        return local / jnp.maximum(mask.sum(), 1.0)
    scaled = devices * local  # exact where the device count is a power of two
    total = scaled + jax.lax.stop_gradient(jax.lax.psum(local, axis) - scaled)
    result: jax.Array = total / jnp.maximum(jax.lax.psum(mask.sum(), axis), 1.0)
    return result


def global_row_ids(batch: Batch, axis: str | None) -> jax.Array:
    """Each of this device's rows' place in the global batch."""
    rows = batch["mask"].shape[0]
    first = 0 if axis is None else jax.lax.axis_index(axis) * rows
    return first + jnp.arange(rows)


def normal(rng: jax.Array, batch: Batch, shape: tuple[int, ...], dtype: DTypeLike, axis: str | None) -> jax.Array:
    """``(rows, *shape)`` standard-normal values, row ``i`` drawn from ``rng`` folded with its
    place in the global batch: the same numbers on any strategy and device count."""
    keys = jax.vmap(lambda i: jax.random.fold_in(rng, i))(global_row_ids(batch, axis))
    return jax.vmap(lambda key: jax.random.normal(key, tuple(shape), dtype))(keys)


def all_rows(values: PyTree, axis: str | None) -> PyTree:
    """Every leaf's rows of the whole global batch (an all-gather over ``axis``; ``values``
    itself under ``jit``, whose batch is global)."""
    if axis is None:
        return values
    return jax.tree.map(lambda a: jax.lax.all_gather(a, axis, tiled=True), values)


def shuffled(values: PyTree, rng: jax.Array, batch: Batch, axis: str | None) -> PyTree:
    """Each row's partner under one random permutation of the global batch's real rows drawn from
    ``rng`` (a padded row is no real row's partner, and its own): over the whole batch, whose rows
    this device's are (under ``axis``: the rows gathered, permuted, this device's kept), so the
    same on any strategy and device count."""
    real = all_rows(batch["mask"], axis) > 0
    size = real.shape[0]
    index = jnp.arange(size)
    in_order = jnp.argsort(jnp.where(real, index, size + index))  # the real rows first, then the padded ones
    drawn = jnp.argsort(jnp.where(real, jax.random.uniform(rng, (size,)), 2.0 + index))  # the real ones shuffled
    partners = index.at[in_order].set(drawn)[global_row_ids(batch, axis)]
    return jax.tree.map(lambda a: a[partners], all_rows(values, axis))


def pmean_floats(value: jax.Array, axis_name: str) -> jax.Array:
    """A floating model-state value (batch statistics) averaged over the device axis, exactly
    itself where every device holds the same (a frozen BatchNorm's statistics, or statistics a
    BatchNorm already reduced over the axis: a mean of equal floats can round); counters kept."""
    if not jnp.issubdtype(value.dtype, jnp.floating):
        return value
    bounds = jax.lax.pmax(jnp.stack([value, -value]), axis_name)  # the largest and the smallest, in one reduction
    return jnp.where(bounds[0] == -bounds[1], value, jax.lax.pmean(value, axis_name))
