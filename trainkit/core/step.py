"""The pure step functions: ``(state, batch) -> (state, metrics)``, testable without a Trainer,
and :func:`with_totals`, which merges the metrics into the epoch's device-side totals.

A *loss function* here has the signature of :meth:`trainkit.Trainer.compute_loss`::

    compute_loss(params, batch, rng, *, model_state, train) -> (loss, (predictions, model_state[, logs]))

where ``loss`` holds one value per row of the batch (never a mean: see :func:`_rows`), and the optional ``logs``
(a dict of per-row values: a loss's parts) are reduced as the loss is and logged by name. The step weights each
row by ``mask * sample_weight``; under a named device axis it sums totals and counts across
devices, so the loss of a step is the mean over the real rows of the *global* batch and the
gradient is exactly the single-device gradient.

>>> import jax, jax.numpy as jnp, optax
>>> def compute_loss(params, batch, rng, *, model_state, train):
...     preds = batch["x"] * params
...     return (preds - batch["y"]) ** 2, (preds, model_state)
>>> tx = optax.sgd(0.1)
>>> state = TrainState.create(params=jnp.zeros(()), opt_state=tx.init(jnp.zeros(())), model_state={}, seed=0)
>>> batch = {"x": jnp.ones((4,)), "y": jnp.full((4,), 2.0), "mask": jnp.array([1.0, 1, 1, 0])}
>>> state, metrics = make_train_step(compute_loss, tx, {})(state, batch)
>>> round(float(state.params), 3), float(metrics["loss"].compute())
(0.4, 4.0)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from clu.metrics import LastValue

from trainkit.core.offload import streamed_update, to_device
from trainkit.core.optimizer_groups import OptimizerGroups
from trainkit.core.optimizers import learning_rate
from trainkit.core.sown import split_sown
from trainkit.core.state import Batch, TrainState
from trainkit.core.step_feature import StepFeature, StepUpdate
from trainkit.core.step_helpers import (
    pmean_floats,
    row_weights,
    token_weights,
    weighed_by_tokens,
    weighted_total,
    with_ignored_tokens,
)
from trainkit.core.totals import (
    EpochTotals,
    LossAverage,
    MetricFn,
    PackedTotals,
    Weighted,
    WeightedAverage,
    batch_state,
    pack,
)
from trainkit.core.trainable import Trainable
from trainkit.core.tree import PyTree, TreeFunction
from trainkit.core.watched_batch import RowFacts, WatchedBatch

#: A ``compute_loss``: ``(params, batch, rng, *, model_state, train)`` ->
#: ``(per-row loss, (predictions, model_state[, logs]))``.
LossFn = Callable[..., tuple[jax.Array, tuple[PyTree, ...]]]
Metrics = dict[str, WeightedAverage]
Totals = EpochTotals | PackedTotals
T = TypeVar("T")


@functools.cache
def full_mask(rows: int) -> np.ndarray:
    """The ``mask`` of a batch of ``rows`` real rows, built once per size and shared by every
    such batch (read-only), so that a strategy may keep one device copy of it instead of
    sending it with every step.

    >>> full_mask(3), full_mask(3) is full_mask(3)
    (array([1., 1., 1.], dtype=float32), True)
    """
    mask = np.ones(rows, np.float32)
    mask.setflags(write=False)
    return mask


def _psum(tree: T, axis_name: str | None) -> T:
    if axis_name is None:
        return tree
    summed: T = jax.lax.psum(tree, axis_name)
    return summed


def _step_rng(state: TrainState, axis_name: str | None) -> jax.Array:
    rng = jax.random.fold_in(state.rng, state.step)
    if axis_name is not None:  # dropout masks differ per device
        rng = jax.random.fold_in(rng, jax.lax.axis_index(axis_name))
    return rng


def _rows(
    loss: jax.Array, num_rows: int, name: str = "loss", sown: bool = False, tokens: jax.Array | None = None
) -> jax.Array:
    """Per-row loss values. Raises while tracing for a loss that is not floating (no gradient)
    or not one value per row: a scalar (a batch mean) would count the padded rows of a last
    partial batch. A value a module sows (``sown``: a regulariser of its weights) may be a
    scalar, spread evenly over the rows. ``tokens``: per-token sample weights, each weighing its
    element of the loss before the row's mean (Keras's ``sum_over_batch_size``: the sum of the
    weighted elements over their count), so the loss must have their shape."""
    loss = jnp.asarray(loss)
    what = "The loss" if name == "loss" else f"The {'sown loss' if sown else 'log'} {name!r}"
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise ValueError(
            f"{what} has dtype {loss.dtype}: it must be floating, or it has no gradient. Cast inside compute_loss "
            "only what is not differentiated (labels), never the loss."
        )
    if loss.ndim == 0 and sown:
        return jnp.broadcast_to(loss.astype(jnp.float32), (num_rows,))
    if loss.ndim == 0:
        raise ValueError(
            f"{what} is a scalar: return one value per row (shape ({num_rows},)), e.g. without the final "
            "jnp.mean. trainkit takes the mean itself over the real rows: a mean taken inside counts the padded "
            "rows of a last partial batch (masked out only when each row has its value). A loss over the whole "
            "batch (contrastive) belongs in a train_step, reduced with state.mean(values, batch) "
            "(docs/custom_training.md)."
        )
    if loss.shape[0] != num_rows:
        raise ValueError(
            f"{what} has shape {loss.shape} for a batch of {num_rows} rows: return one value per row (shape "
            f"({num_rows}, ...)), not values of several rows concatenated."
        )
    loss = loss.astype(jnp.float32)
    if tokens is not None:
        loss = weighed_by_tokens(loss, tokens, what)
    return loss.reshape(num_rows, -1).mean(axis=1)


def _loss_total(row_loss: jax.Array, batch: Batch) -> jax.Array:
    """``sum(loss * sample_weight)`` over the real rows (padded rows dropped, even if NaN)."""
    return weighted_total(row_loss, batch["mask"], row_weights(batch))


def _batch_metrics(
    metric_fns: Mapping[str, MetricFn],
    predictions,
    batch: Batch,
    loss_total,
    logs: Mapping[str, jax.Array],
    weighting: Batch | None = None,
) -> Metrics:
    """Masked totals and counts of one (device-local) batch; sum them across devices. As in
    Keras, sample weights apply to the loss and to ``weighted_metrics`` only; other metrics
    count every real row once. ``logs`` (a loss's parts, per row) are reduced as the loss is
    (by ``weighting``: the batch, without its weights when the loss applied them itself)."""
    mask = batch["mask"]
    weights = row_weights(batch)
    tokens = token_weights(batch if weighting is None else weighting)  # the loss's, where it did not apply them
    given = token_weights(batch)
    weighted = sorted(name for name, fn in metric_fns.items() if isinstance(fn, Weighted))
    if given is not None and weighted:
        raise ValueError(
            f"weighted_metrics {weighted} weigh rows, and this batch's sample_weight is per token (shape "
            f"{given.shape}): pass them as metrics= (each real row's tokens counted alike), or give one weight per row."
        )
    # The loss follows Keras: sum(loss * sample_weight) / (number of real rows).
    metrics = {"loss": LossAverage(total=loss_total, count=mask.sum())}
    for name, values in logs.items():
        logged = _rows(values, mask.shape[0], name, tokens=tokens)
        metrics[name] = LossAverage(
            total=_loss_total(logged, batch if weighting is None else weighting), count=mask.sum()
        )
    for name, fn in metric_fns.items():
        metrics[name] = batch_state(fn, predictions, batch.get("y"), mask=mask, weights=weights)
    return metrics


def loss_parts(
    result: object, rows: int, metric_names: Iterable[str] = (), tokens: jax.Array | None = None
) -> tuple[jax.Array, tuple[PyTree, PyTree, dict[str, jax.Array]]]:
    """``compute_loss``'s result as ``(row_loss, (predictions, model_state, logs))`` for a batch of
    ``rows`` (``tokens``: per-token sample weights the loss did not apply itself, applied to its
    elements: :func:`_rows`): ``logs`` empty when it returned two parts; the losses the model sowed
    (:mod:`trainkit.core.sown`) taken out of the model state, added to the loss and logged. Raises,
    naming the contract, for any other structure, for logs that are not a dict of values by name,
    or that take a name the logs already have."""
    aux = result[1] if isinstance(result, tuple) and len(result) == 2 else None
    if not isinstance(aux, tuple) or len(aux) not in (2, 3):
        raise TypeError(
            "compute_loss must return (per_example_loss, (predictions, model_state)) or (per_example_loss, "
            f"(predictions, model_state, logs)), logs a dict of per-row values; received {_shape_of(result)}."
        )
    logs = aux[2] if len(aux) == 3 else {}
    if not isinstance(logs, Mapping) or not all(isinstance(k, str) for k in logs):
        raise TypeError(
            f"compute_loss's logs (the third part of its second value) must be a dict of per-row values by name, "
            f"e.g. {{'kl_loss': kl}}; received {type(logs).__name__}."
        )
    model_state, sown = split_sown(aux[1])
    taken = sorted((set(logs) | set(sown)) & {"loss", *metric_names}) + sorted(set(logs) & set(sown))
    if taken:
        raise ValueError(
            f"compute_loss logs (or the model sows) {taken}, which the logs already hold (the loss, a metric, or "
            "another log): name them otherwise, e.g. 'reconstruction_loss'."
        )
    row_loss = _rows(result[0], rows, tokens=tokens)  # type: ignore[index]  # checked above
    sown = {name: _rows(value, rows, name, sown=True) for name, value in sown.items()}
    for value in sown.values():
        row_loss = row_loss + value
    return row_loss, (aux[0], model_state, {**logs, **sown})


def _shape_of(value: object) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(_shape_of(v) for v in value) + ")"
    return f"an array {tuple(value.shape)}" if isinstance(value, (jax.Array, np.ndarray)) else type(value).__name__


def _microbatches(batch: Batch, k: int) -> Batch:
    """``(k, rows / k, ...)``: micro-batch ``j`` holds rows ``j, j + k, j + 2k, ...``. Strided,
    not contiguous: every device's (contiguous) part of a sharded batch contributes equally to
    every micro-batch, so no rows move between devices, and the micro-batches are the same
    rows under every strategy (the device parts divide by ``k``)."""
    micro: Batch = jax.tree.map(lambda a: jnp.swapaxes(a.reshape((a.shape[0] // k, k) + a.shape[1:]), 0, 1), batch)
    return micro


def _batch_rows(batch: Batch, axis_name: str | None) -> jax.Array:
    """What a step's masked loss sum is divided by before differentiation."""
    if axis_name is None:  # jit: the mask is the global batch's, so divide by its real rows
        return jnp.maximum(batch["mask"].sum(), 1.0)
    # pmap: differentiate the masked loss sum over the *static* global batch size, then
    # rescale by static / real rows after the one all-reduce: the exact gradient of the
    # mean over the real rows, with no collective before the forward pass.
    rows: jax.Array = batch["mask"].shape[0] * jax.lax.psum(1, axis_name)
    return rows


def _rescaled(grads: PyTree, factor: jax.Array) -> PyTree:
    return jax.tree.map(lambda g: (g * factor).astype(g.dtype), grads)


def _tokens_weighed(batch: Batch, valid_tokens: Callable[[PyTree], jax.Array] | None, axis_name: str | None) -> Batch:
    """``batch`` with its tokens weighed where the loss ignores a class (:func:`with_ignored_tokens`)."""
    if valid_tokens is None or "y" not in batch:
        return batch
    return with_ignored_tokens(batch, valid_tokens(batch["y"]), axis_name)


def _accumulated(
    micro_step: Callable[..., tuple[PyTree, PyTree, Metrics]],
    state: TrainState,
    batch: Batch,
    rng: jax.Array,
    batch_rows: jax.Array,
    steps: int,
) -> tuple[PyTree, PyTree, Metrics]:
    """``micro_step`` over ``steps`` micro-batches of ``batch`` in a ``lax.scan``: the summed
    gradients and metrics, and the model state after the last micro-batch."""
    loss_scale = state.loss_scale

    def body(carry, inputs):
        grads, model_state, metrics = carry
        index, micro = inputs
        g, model_state, m = micro_step(
            state.params, model_state, micro, jax.random.fold_in(rng, index), batch_rows, loss_scale
        )
        return (jax.tree.map(jnp.add, grads, g), model_state, jax.tree.map(jnp.add, metrics, m)), None

    micro = _microbatches(batch, steps)
    first = jax.tree.map(lambda a: a[0], micro)
    zeros = jax.eval_shape(micro_step, state.params, state.model_state, first, rng, batch_rows, loss_scale)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (zeros[0], zeros[2]))
    (grads, model_state, metrics), _ = jax.lax.scan(
        body, (zeros[0], state.model_state, zeros[1]), (jnp.arange(steps), micro)
    )
    return grads, model_state, metrics


def _observed(metrics: Metrics, new_state: TrainState, groups: OptimizerGroups | None = None) -> Metrics:
    """The step's learning rate (when the optimizer injects it; each group's as ``learning_rate/<group>``
    under an optimizer per group) and its loss scale, added to ``metrics``."""
    parts = {"learning_rate": new_state.opt_state} if groups is None else {
        f"learning_rate/{name}": groups.inner_state(new_state.opt_state, name) for name in groups.names
    }  # fmt: skip
    for name, opt_state in parts.items():
        rate = learning_rate(opt_state)
        if rate is not None:
            metrics = {**metrics, name: LastValue(value=jnp.asarray(rate, jnp.float32))}
    return {**metrics, **new_state.loss_scale.metrics()}


@dataclasses.dataclass(frozen=True)
class TrainStepOptions:
    """How :func:`make_train_step` trains besides the loss and optimizer: ``grad_accum_steps``
    micro-batches per update, the ``trainable`` leaves (``None``: all), and the step's
    ``features`` (:mod:`trainkit.core.step_feature`), run in order after the update; and
    ``offload``: the optimizer's state is in host memory, streamed through the update
    (:func:`trainkit.core.offload.streamed_update`); ``groups``: the optimizer's groups (a dict
    of optimizers by parameter path). A step of the user's own is not built here
    (:func:`trainkit.core.custom_step.make_custom_train_step`)."""

    grad_accum_steps: int = 1
    trainable: Trainable | None = None
    features: tuple[StepFeature, ...] = ()
    offload: bool = False
    groups: OptimizerGroups | None = None
    #: the targets' tokens that count, where the loss ignores a class (Keras's ``ignore_class``; ``None``: all)
    valid_tokens: Callable[[PyTree], jax.Array] | None = None


def make_train_step(
    compute_loss: LossFn,
    tx: optax.GradientTransformation,
    metric_fns: Mapping[str, MetricFn],
    axis_name: str | None = None,
    options: TrainStepOptions = TrainStepOptions(),
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """The pure training step; ``axis_name`` names the device axis under ``pmap``/``shard_map``.

    ``options.grad_accum_steps=k``: ``k`` micro-batches one after another (a ``lax.scan``), the
    update that of the whole batch. ``state.loss_scale`` (:mod:`trainkit.core.precision`) scales
    the loss, unscales the gradients and skips a step whose gradients are not finite (the state
    kept but for ``step``, the scale and the rng; its metrics count nothing).
    ``options.trainable``: only its leaves are differentiated and updated. ``options.features``
    (spike skipping, the gradient norm, gradient statistics, the label check: see
    :mod:`trainkit.core.features`) each map the step's :class:`StepUpdate` to the next.
    """
    grad_accum_steps, features = options.grad_accum_steps, options.features
    update_optimizer = functools.partial(streamed_update, tx) if options.offload else tx.update
    trainable = options.trainable if options.trainable is not None else Trainable(None)
    freezes = trainable.freezes

    def micro_step(params, model_state, batch, rng, batch_rows, loss_scale, *, rows: RowFacts):
        trained, rebuild = (params, None) if not freezes else trainable.split(params)

        watched = WatchedBatch.of(batch, rows)  # notes whether compute_loss applies the sample weights itself

        def objective(trained):
            full = to_device(trained if rebuild is None else rebuild(trained))  # offloaded frozen leaves, streamed
            result = compute_loss(full, watched, rng, model_state=model_state, train=True)
            weighting = watched.weighting()  # without the weights when the loss applied them itself
            row_loss, (predictions, new_model_state, logs) = loss_parts(
                result, batch["mask"].shape[0], metric_fns, token_weights(weighting)
            )
            total = _loss_total(row_loss, weighting)
            return loss_scale.scale(total / batch_rows), (total, predictions, new_model_state, logs)

        with jax.named_scope("loss_and_gradients"):  # a profile's names for the step's phases (kauldron's way)
            grads, (total, predictions, model_state, logs) = jax.grad(objective, has_aux=True)(trained)
        grads = grads if rebuild is None else trainable.full_grads(params, grads)
        with jax.named_scope("metrics"):
            metrics = _batch_metrics(metric_fns, predictions, batch, total, logs, watched.weighting())
        return grads, model_state, metrics

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        batch = _tokens_weighed(batch, options.valid_tokens, axis_name)  # the whole batch's, before micro-batches
        rng, batch_rows, loss_scale = _step_rng(state, axis_name), _batch_rows(batch, axis_name), state.loss_scale
        micro = partial(micro_step, rows=RowFacts(axis_name, rng, _step_rng(state, None)))  # batch.normal's keys
        if grad_accum_steps == 1:
            grads, model_state, metrics = micro(state.params, state.model_state, batch, rng, batch_rows, loss_scale)
        else:
            grads, model_state, metrics = _accumulated(micro, state, batch, rng, batch_rows, grad_accum_steps)
        with jax.named_scope("all_reduce"):
            grads, metrics = _psum((grads, metrics), axis_name)  # one all-reduce
        if axis_name is not None:
            model_state = jax.tree.map(partial(pmean_floats, axis_name=axis_name), model_state)
            grads = _rescaled(grads, batch_rows / metrics["loss"].count)  # static rows / real rows
        grads = loss_scale.unscale(grads)
        with jax.named_scope("optimizer_update"):
            updates, opt_state = update_optimizer(grads, state.opt_state, state.params)
        with jax.named_scope("apply_updates"):
            params = trainable.apply_updates(state.params, updates)
        skipped = jax.tree.map(jnp.zeros_like, metrics)  # a skipped step's loss is not an observation
        (params, opt_state, model_state, metrics), loss_scale = loss_scale.guard(
            grads,
            new=(params, opt_state, model_state, metrics),
            old=(state.params, state.opt_state, state.model_state, skipped),
        )
        updated = {"params": params, "opt_state": opt_state, "model_state": model_state, "loss_scale": loss_scale}
        update = StepUpdate(
            state, state.replace(step=state.step + 1, **updated), grads, updates, metrics, batch, axis_name
        )
        for feature in features:
            update = feature(update)
        return update.after, _observed(update.metrics, update.after, options.groups)

    return train_step


def make_eval_step(
    compute_loss: LossFn,
    metric_fns: Mapping[str, MetricFn],
    axis_name: str | None = None,
    valid_tokens: Callable[[PyTree], jax.Array] | None = None,
) -> Callable[[TrainState, Batch], Metrics]:
    """Masked loss and metric sums of one batch, in inference mode (``compute_loss``'s
    ``batch.normal`` / ``batch.all_rows`` under ``axis_name``; ``valid_tokens``: as
    :class:`TrainStepOptions` says)."""

    def eval_step(state: TrainState, batch: Batch) -> Metrics:
        batch = _tokens_weighed(batch, valid_tokens, axis_name)
        watched = WatchedBatch.of(batch, RowFacts(axis_name))
        result = compute_loss(to_device(state.params), watched, state.rng, model_state=state.model_state, train=False)
        weighting = watched.weighting()  # without the weights when the loss applied them itself
        row_loss, (predictions, _, logs) = loss_parts(
            result, batch["mask"].shape[0], metric_fns, token_weights(weighting)
        )
        loss_total = _loss_total(row_loss, weighting)
        return _psum(_batch_metrics(metric_fns, predictions, batch, loss_total, logs, weighting), axis_name)

    return eval_step


def make_predict_step(apply: Callable[..., tuple[Any, Any]]) -> Callable[[TrainState, Batch], Any]:
    """The model's outputs for a batch, in inference mode (padded rows included)."""

    def predict_step(state: TrainState, batch: Batch):
        outputs, _ = apply(to_device(state.params), state.model_state, batch["x"], rng=state.rng, train=False)
        return outputs

    return predict_step


def with_totals(step: TreeFunction, *, trains: bool = True) -> TreeFunction:
    """A train step ``(state, batch) -> (state, metrics)`` as ``(state, totals, batch) ->
    (state, totals)``, or (``trains=False``) an eval step ``(state, batch) -> metrics`` as
    ``(state, totals, batch) -> totals``: the metrics merged into the epoch's
    :class:`~trainkit.core.totals.EpochTotals` inside the compiled step, so the host reads
    them only when something needs the logs.

    >>> import jax.numpy as jnp, optax
    >>> def compute_loss(params, batch, rng, *, model_state, train):
    ...     return (batch["x"] * params - batch["y"]) ** 2, (None, model_state)
    >>> tx = optax.sgd(0.1)
    >>> state = TrainState.create(params=jnp.zeros(()), opt_state=tx.init(jnp.zeros(())), model_state={}, seed=0)
    >>> batch = {"x": jnp.ones((2,)), "y": jnp.full((2,), 2.0), "mask": jnp.ones((2,))}
    >>> step = make_train_step(compute_loss, tx, {})
    >>> totals = EpochTotals.empty(jax.eval_shape(step, state, batch)[1])
    >>> state, totals = with_totals(step)(state, totals, batch)
    >>> int(totals.steps), float(totals.metrics["loss"].compute())
    (1, 4.0)
    """
    if not trains:

        def eval_step(state: TrainState, totals: Totals, batch: Batch) -> Totals:
            return _merged(totals, step(state, batch))

        return eval_step

    def train_step(state: TrainState, totals: Totals, batch: Batch) -> tuple[TrainState, Totals]:
        state, metrics = step(state, batch)
        return state, _merged(totals, metrics)

    return train_step


def _merged(totals: Totals, metrics: Metrics) -> Totals:
    """``totals`` with one step's metrics added, in the form it came in: the loop passes
    :class:`~trainkit.core.totals.PackedTotals` (fewer buffers per call), a direct caller may
    pass :class:`~trainkit.core.totals.EpochTotals`."""
    if isinstance(totals, PackedTotals):
        return pack(totals.unpack().add(metrics))
    return totals.add(metrics)


#: the platforms on which a fused call unpacks the loop's packed totals once, for its k steps, instead of at
#: every step: on a TPU the per-step slices and concatenates were serialised scalar work (the dispatch MLP's
#: k=128 call 1.382 -> 0.970 ms of device time); on a CPU the scan carried fewer buffers packed and ran
#: faster so (k=32 about 1.1x of the hand scan packed, 0.73-0.85 unpacked; issue #80, docs/performance.md)
TOTALS_UNPACKED_ON = frozenset({"tpu"})


def make_multi_step(
    train_step: Callable[[TrainState, Totals, Batch], tuple[TrainState, Totals]],
    *,
    unrolled: bool = False,
    unpack_totals: bool = False,
) -> Callable[[TrainState, Totals, Batch], tuple[TrainState, Totals]]:
    """``k`` training steps in one call: ``(state, totals, batches) -> (state, totals)``, where
    every leaf of ``batches`` stacks ``k`` batches on a new leading axis and ``train_step`` is a
    step of :func:`with_totals`. A ``lax.scan`` over the steps: compiled, the ``k`` steps are
    one dispatch (Keras's ``steps_per_execution``). ``unrolled``: a Python loop instead, for
    uncompiled (eager) runs; ``unpack_totals``: packed totals unpacked once before the steps and
    packed once after, not at every step (:data:`TOTALS_UNPACKED_ON`).

    >>> import jax.numpy as jnp, optax
    >>> def compute_loss(params, batch, rng, *, model_state, train):
    ...     return (batch["x"] * params - batch["y"]) ** 2, (None, model_state)
    >>> tx = optax.sgd(0.1)
    >>> state = TrainState.create(params=jnp.zeros(()), opt_state=tx.init(jnp.zeros(())), model_state={}, seed=0)
    >>> batches = {"x": jnp.ones((3, 2)), "y": jnp.full((3, 2), 2.0), "mask": jnp.ones((3, 2))}
    >>> step = make_train_step(compute_loss, tx, {})
    >>> totals = EpochTotals.empty(jax.eval_shape(step, state, batches_at(batches, 0))[1])
    >>> state, totals = make_multi_step(with_totals(step))(state, totals, batches)
    >>> int(state.step), int(totals.steps)
    (3, 3)
    """

    def steps(state: TrainState, totals: Totals, batches: Batch) -> tuple[TrainState, Totals]:
        if unrolled:
            for index in range(len(jax.tree.leaves(batches)[0])):
                state, totals = train_step(state, totals, batches_at(batches, index))
            return state, totals
        (state, totals), _ = jax.lax.scan(lambda carry, b: (train_step(*carry, b), None), (state, totals), batches)
        return state, totals

    def multi_step(state: TrainState, totals: Totals, batches: Batch) -> tuple[TrainState, Totals]:
        if unpack_totals and isinstance(totals, PackedTotals):
            state, plain = steps(state, totals.unpack(), batches)
            assert isinstance(plain, EpochTotals)  # the steps keep the form they are given
            return state, pack(plain)
        return steps(state, totals, batches)

    return multi_step


def make_gathered_steps(
    multi_step: Callable[[TrainState, Totals, Batch], tuple[TrainState, Totals]],
) -> Callable[[TrainState, Totals, Batch], tuple[TrainState, Totals]]:
    """``multi_step`` (:func:`make_multi_step`) fed from data kept on the devices: its batch is
    ``{"table": every row's parts, "rows": (k, batch) indices, "mask": (k, batch)}``, and the
    call gathers the ``k`` batches with one take of each array, then runs the same steps on them
    (so the numbers are those of the host's batches).

    >>> import jax.numpy as jnp
    >>> seen = make_gathered_steps(lambda state, totals, batches: (state, batches))
    >>> table = {"x": jnp.arange(5.0) * 10}
    >>> seen(0, None, {"table": table, "rows": jnp.array([[4, 0]]), "mask": jnp.ones((1, 2))})[1]["x"].tolist()
    [[40.0, 0.0]]
    """

    def gathered_steps(state: TrainState, totals: Totals, batch: Batch) -> tuple[TrainState, Totals]:
        rows = batch["rows"]
        batches = {name: jax.tree.map(lambda a: a[rows], part) for name, part in batch["table"].items()}
        return multi_step(state, totals, {**batches, "mask": batch["mask"]})

    return gathered_steps


def batches_at(stacked: PyTree, index: int) -> PyTree:
    """Entry ``index`` of every leaf stacked on a leading axis (one step's batch)."""
    return jax.tree.map(lambda a: a[index], stacked)
