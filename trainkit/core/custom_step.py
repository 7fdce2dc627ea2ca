"""A train step of the user's own (``Trainer.train_step(state, batch, rng) -> (state, logs)``)
and the pure helpers it calls, bound to the strategy's facts while the step is traced: the
device axis under ``pmap`` (``None`` under ``jit``), the optimizer and its groups, the frozen
parameters. Each helper gives the same numbers under every strategy and device count:

- :func:`mean`: the masked, weighted mean over the *global* batch (the built-in loss's
  reduction). Under a device axis its value is the global mean and its gradient is this
  device's share of it, so that :func:`apply_gradients`, which sums the gradients over the
  axis, gets exactly the single-device gradient;
- :func:`apply_gradients`: the optimizer's update of one group's parameters (all: ``None``)
  and only that group's optimizer state;
- :func:`normal`: one standard-normal draw per row, keyed by the row's place in the global
  batch (not by the device);
- :func:`all_rows`: the global batch's rows of a per-row value (an all-gather over the axis).

:func:`normal` and :func:`all_rows` also serve a ``compute_loss`` (the built-in step binds them too).

:func:`make_custom_train_step` turns the user's step into the ``(state, batch) -> (state,
metrics)`` every strategy compiles and fuses: the step count advances, the logs (scalars)
become metrics weighted by the step's real rows, as the built-in logs are.

>>> import jax, jax.numpy as jnp, optax
>>> from trainkit.core.state import TrainState
>>> from trainkit.core.trainable import Trainable
>>> def step(state, batch, rng):
...     def loss_fn(params):
...         return mean((batch["x"] * params - batch["y"]) ** 2, batch)
...     loss, grads = jax.value_and_grad(loss_fn)(state.params)
...     return apply_gradients(state, grads), {"loss": loss}
>>> tx = optax.sgd(0.1)
>>> context = StepContext(axis_name=None, optimizer=tx, groups=None, trainable=Trainable(None))
>>> state = TrainState.create(params=jnp.zeros(()), opt_state=tx.init(jnp.zeros(())), model_state={}, seed=0)
>>> batch = {"x": jnp.ones((4,)), "y": jnp.full((4,), 2.0), "mask": jnp.array([1.0, 1, 1, 0])}
>>> state, metrics = make_custom_train_step(step, context)(state, batch)
>>> int(state.step), round(float(state.params), 3), float(metrics["loss"].compute())
(1, 0.4, 4.0)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from trainkit.core.optimizer_groups import OptimizerGroups
from trainkit.core.scoped import scoped
from trainkit.core.sown import split_sown
from trainkit.core.state import Batch, TrainState, check_tree_matches
from trainkit.core.totals import LossAverage
from trainkit.core.trainable import Trainable
from trainkit.core.tree import PyTree

#: ``train_step(state, batch, rng) -> (state, logs)``
UserTrainStep = Callable[[TrainState, Batch, jax.Array], tuple[TrainState, dict[str, jax.Array]]]
#: ``test_step(state, batch, rng) -> logs``
UserTestStep = Callable[[TrainState, Batch, jax.Array], dict[str, jax.Array]]


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What the helpers need to know of the step being traced: the device axis (``pmap``; ``None``
    under ``jit``, where the batch is global), the whole optimizer (frozen leaves included), its
    groups (``None``: one optimizer), and which parameters train."""

    axis_name: str | None
    optimizer: optax.GradientTransformation
    groups: OptimizerGroups | None
    trainable: Trainable
    #: the built-in step under a device axis: the key ``compute_loss`` receives (folded with the
    #: device's index) and the step's own, which :func:`normal` draws from in its place
    device_rng: jax.Array | None = None
    step_rng: jax.Array | None = None

    def with_rngs(self, device_rng: jax.Array, step_rng: jax.Array) -> StepContext:
        return dataclasses.replace(self, device_rng=device_rng, step_rng=step_rng)


_ACTIVE: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar("trainkit_custom_step", default=None)


def active(context: StepContext) -> contextlib.AbstractContextManager[None]:
    """The helpers bound to ``context`` while a step is traced (or run eagerly)."""
    return scoped(_ACTIVE, context)


def _context(helper: str) -> StepContext:
    context = _ACTIVE.get()
    if context is None:
        raise RuntimeError(
            f"trainer.{helper}(...) is a helper of a train_step or test_step of your own: it reads the strategy's "
            "device axis and the optimizer while trainkit traces that step, so call it inside "
            "train_step(self, state, batch, rng) or test_step(self, state, batch, rng), never outside."
        )
    return context


def row_weights(batch: Batch) -> jax.Array:
    """Each row's weight: ``mask * sample_weight`` (padded rows 0)."""
    mask = batch["mask"]
    weights: jax.Array = mask * batch["sample_weight"] if "sample_weight" in batch else mask
    return weights


def weighted_total(row_values: jax.Array, mask: jax.Array, weights: jax.Array) -> jax.Array:
    """``sum(values * weights)`` over the real rows (padded rows dropped, even if NaN)."""
    return jnp.where(mask > 0, row_values * weights, 0).sum()


def _per_row(values: jax.Array, rows: int, helper: str) -> jax.Array:
    values = jnp.asarray(values)
    if values.ndim == 0 or values.shape[0] != rows:
        raise ValueError(
            f"trainer.{helper} takes one value per row of the batch (shape ({rows}, ...)); received shape "
            f"{values.shape}. Compute the loss per row (no jnp.mean over the batch) and let trainer.{helper} reduce it."
        )
    return values.astype(jnp.float32).reshape(rows, -1).mean(axis=1)


def _share(total: jax.Array, devices: int) -> jax.Array:
    """``total`` (the same on every device) whose gradient is ``1 / devices`` of it: summed over
    the devices by :func:`apply_gradients`, the gradient of ``total`` itself."""
    share = total / devices
    return share + jax.lax.stop_gradient(total - share)


def mean(values: jax.Array, batch: Batch) -> jax.Array:
    """The mean of per-row ``values`` over the real rows of the global batch, each weighted by its
    ``sample_weight`` (``sum(values * sample_weight) / real rows``, Keras's loss reduction): padded
    rows are left out, even if NaN. ``values`` has this device's rows (the batch's) or, from
    :func:`all_rows`, the global batch's."""
    context, mask = _context("mean"), batch["mask"]
    rows, weights = mask.shape[0], row_weights(batch)
    axis = context.axis_name
    devices = 1 if axis is None else jax.lax.axis_size(axis)
    if devices > 1 and jnp.shape(values)[:1] == (rows * devices,):
        mask, weights = all_rows(mask), all_rows(weights)  # values of the global batch: reduced on every device
        row_values = _per_row(values, mask.shape[0], "mean")
        total = weighted_total(row_values, mask, weights) / jnp.maximum(mask.sum(), 1.0)
        return _share(total, devices)
    local = weighted_total(_per_row(values, rows, "mean"), mask, weights)
    if axis is None:
        return local / jnp.maximum(mask.sum(), 1.0)
    # the global total's value, this device's rows' gradient: apply_gradients sums the devices' gradients
    total = local + jax.lax.stop_gradient(jax.lax.psum(local, axis) - local)
    mean: jax.Array = total / jnp.maximum(jax.lax.psum(mask.sum(), axis), 1.0)
    return mean


def _global_row_ids(batch: Batch, axis: str | None) -> jax.Array:
    rows = batch["mask"].shape[0]
    first = 0 if axis is None else jax.lax.axis_index(axis) * rows
    return first + jnp.arange(rows)


def normal(rng: jax.Array, batch: Batch, shape: tuple[int, ...] = (), dtype: Any = jnp.float32) -> jax.Array:
    """``(rows, *shape)`` standard-normal values, row ``i`` drawn from ``rng`` folded with its
    place in the global batch: the same numbers on any strategy and device count (a GAN's ``z``,
    a VAE's noise). In ``compute_loss``, pass the ``rng`` it received as it is: under a device axis
    that key is the device's, and the step's own is drawn from instead."""
    context = _context("normal")
    if context.step_rng is not None and rng is context.device_rng:
        rng = context.step_rng
    keys = jax.vmap(lambda i: jax.random.fold_in(rng, i))(_global_row_ids(batch, context.axis_name))
    return jax.vmap(lambda key: jax.random.normal(key, tuple(shape), dtype))(keys)


def all_rows(values: PyTree) -> PyTree:
    """Every leaf's rows of the whole global batch (an all-gather over the device axis; itself
    under ``jit``, whose batch is global). ``all_rows(batch["mask"])`` says which are real: leave
    the padded ones out of a batch-level loss (NT-Xent's negatives)."""
    axis = _context("all_rows").axis_name
    if axis is None:
        return values
    return jax.tree.map(lambda a: jax.lax.all_gather(a, axis, tiled=True), values)


def apply_gradients(state: TrainState, grads: PyTree, group: str | None = None) -> TrainState:
    """``state`` with the optimizer's update from ``grads`` (shaped as ``state.params``) applied
    to ``group``'s parameters and optimizer state (``None``: every group); frozen parameters and
    the other groups untouched, bit for bit. Under a device axis the gradients are summed over it
    first (:func:`mean`'s gradients are each device's share)."""
    context = _context("apply_gradients")
    if group is not None and context.groups is None:
        raise ValueError(
            f"apply_gradients(..., group={group!r}) updates one optimizer group, but the trainer has one optimizer. "
            "Give one per sub-network, optimizer={'generator': ..., 'discriminator': ...}, or pass group=None."
        )
    if group is not None:
        assert context.groups is not None
        context.groups.require(group)
    check_tree_matches("apply_gradients(state, grads): grads", state.params, grads)
    trainable = context.trainable
    if context.axis_name is not None:
        grads = _summed(grads, state.params, context, group)
    if group is None:
        updates, opt_state = context.optimizer.update(grads, state.opt_state, state.params)
        return state.replace(params=trainable.apply_updates(state.params, updates), opt_state=opt_state)
    assert context.groups is not None
    params, opt_state = context.groups.update(state.params, state.opt_state, grads, group, trainable.trains)
    return state.replace(params=params, opt_state=opt_state)


def _summed(grads: PyTree, params: PyTree, context: StepContext, group: str | None) -> PyTree:
    """The gradients of the leaves the update reads summed over the device axis (one all-reduce;
    the frozen leaves and other groups' are left as they are: nothing reads them)."""
    assert context.axis_name is not None
    if context.groups is None or group is None:
        mask = context.trainable.mask(params)
    else:
        mask = jax.tree.map(lambda label: label == group, context.groups.labels(params, context.trainable.trains))
    leaves, treedef = jax.tree.flatten(grads)
    flags = jax.tree.leaves(mask)
    summed = iter(jax.lax.psum([g for g, f in zip(leaves, flags) if f], context.axis_name))
    return jax.tree.unflatten(treedef, [next(summed) if f else g for g, f in zip(leaves, flags)])


def pmean_floats(value: jax.Array, axis_name: str) -> jax.Array:
    """A floating model-state value (batch statistics) averaged over the device axis, exactly
    itself where every device holds the same (a frozen BatchNorm's statistics, or statistics a
    BatchNorm already reduced over the axis: a mean of equal floats can round); counters kept."""
    if not jnp.issubdtype(value.dtype, jnp.floating):
        return value
    bounds = jax.lax.pmax(jnp.stack([value, -value]), axis_name)  # the largest and the smallest, in one reduction
    return jnp.where(bounds[0] == -bounds[1], value, jax.lax.pmean(value, axis_name))


def _checked_logs(logs: object, where: str) -> dict[str, jax.Array]:
    if not isinstance(logs, dict) or not all(isinstance(k, str) for k in logs):
        raise TypeError(
            f"{where} must return its logs as a dict of scalars by name, e.g. {{'d_loss': d_loss, 'g_loss': g_loss}}; "
            f"received {type(logs).__name__}."
        )
    wrong = {k: jnp.shape(v) for k, v in logs.items() if jnp.ndim(v) != 0}
    if wrong:
        raise ValueError(
            f"{where} returned logs that are not scalars: {wrong}. Log one number per step (reduce per-row values "
            "with trainer.mean(values, batch))."
        )
    return {k: jnp.asarray(v, jnp.float32) for k, v in logs.items()}


def _step_metrics(logs: dict[str, jax.Array], batch: Batch, axis: str | None) -> dict[str, LossAverage]:
    """Each log weighted by the step's real rows (an epoch's log: the mean of its steps' logs
    weighted by their rows, as the built-in logs are)."""
    rows = batch["mask"].sum()
    rows = rows if axis is None else jax.lax.psum(rows, axis)
    return {name: LossAverage(total=value * rows, count=rows) for name, value in logs.items()}


def make_custom_train_step(
    user_step: UserTrainStep, context: StepContext
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, LossAverage]]]:
    """The user's ``train_step`` as the step every strategy compiles: its ``rng`` is the state's
    folded with the step number (the same on every device), its state checked against the one
    it was given (same structure and shapes), its step count advanced, its model state averaged
    over the device axis (batch statistics), its logs weighted by the real rows."""
    axis = context.axis_name

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, LossAverage]]:
        rng = jax.random.fold_in(state.rng, state.step)
        with active(context):
            result = user_step(state, batch, rng)
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], TrainState)):
            raise TypeError(
                "train_step(self, state, batch, rng) must return (state, logs): the new TrainState (from "
                "self.apply_gradients(state, grads, ...) or state.replace(...)) and a dict of scalar logs; received "
                f"{_describe(result)}."
            )
        new_state, logs = result
        check_tree_matches("The state train_step returned", state.params, new_state.params)
        if str(jax.tree.structure(new_state.opt_state)) != str(jax.tree.structure(state.opt_state)):
            raise ValueError(
                "The state train_step returned has another optimizer state structure than the one it was given: "
                "update it only through self.apply_gradients(state, grads, group=...)."
            )
        model_state = split_sown(new_state.model_state)[0]  # losses the model sowed are each call's, not state
        if axis is not None:
            model_state = jax.tree.map(lambda v: pmean_floats(v, axis), model_state)
        new_state = new_state.replace(
            step=state.step + 1, rng=state.rng, loss_scale=state.loss_scale, spikes=state.spikes,
            model_state=model_state,
        )  # fmt: skip
        return new_state, _step_metrics(_checked_logs(logs, "train_step"), batch, axis)

    return train_step


def make_custom_eval_step(
    user_step: UserTestStep, context: StepContext
) -> Callable[[TrainState, Batch], dict[str, LossAverage]]:
    """The user's ``test_step`` as the eval step (its logs weighted by the real rows)."""

    def eval_step(state: TrainState, batch: Batch) -> dict[str, LossAverage]:
        with active(context):
            logs = user_step(state, batch, state.rng)
        return _step_metrics(_checked_logs(logs, "test_step"), batch, context.axis_name)

    return eval_step


def overridden(method: Callable[..., object], default: Callable[..., object], owner: str) -> bool:
    """Whether ``method`` (a class's ``train_step`` / ``test_step``) overrides the ``default`` one;
    raises for an override that does not take ``(state, batch, rng)`` (Keras's ``train_step(self,
    state, data)`` or ``train_step(self, data)``, which trainkit would otherwise never call)."""
    if method is default:
        return False
    name = default.__name__
    try:
        parameters = list(inspect.signature(method).parameters.values())[1:]  # after self
    except (TypeError, ValueError):
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not any(p.kind == p.VAR_POSITIONAL for p in parameters) and len(positional) != 3:
        returns = "(state, logs)" if name == "train_step" else "logs"
        raise TypeError(
            f"{owner}.{name} takes ({', '.join(p.name for p in parameters)}), but trainkit calls "
            f"{name}(self, state, batch, rng) -> {returns}: state a TrainState (state.params, state.opt_state, "
            "state.model_state), batch a dict ('x', 'y', 'mask', maybe 'sample_weight'), rng this step's key. "
            "Keras's train_step(self, state, data) / train_step(self, data) map onto it as docs/custom_training.md "
            "shows (gradients through self.apply_gradients(state, grads), losses through self.mean(values, batch))."
        )
    return True


def not_callable(name: str) -> NotImplementedError:
    """What calling the default ``train_step`` / ``test_step`` raises: ``super().train_step(...)``,
    or an evaluation of a trainer whose own ``train_step`` has no loss to evaluate by."""
    if name == "test_step":
        return NotImplementedError(
            "evaluate and validation run test_step(self, state, batch, rng) -> logs, and this trainer has a "
            "train_step of its own but neither loss= nor compute_loss for the built-in evaluation: override "
            "test_step (e.g. return {'d_loss': self.mean(per_row, batch)}), or pass loss=... ."
        )
    return NotImplementedError(
        "Trainer.train_step has no body to call: without an override trainkit runs its built-in step (compute_loss, "
        "the optimizer, the metrics) directly. In an override, compute the loss with self.compute_loss(...) or "
        "self.apply(...) and self.mean(...), and update with self.apply_gradients(state, grads)."
    )


def device_rng(rng: jax.Array) -> jax.Array:
    """Inside a custom step under a device axis: ``rng`` folded with the device's index (dropout
    masks differ between devices, as in the built-in step); else ``rng`` itself."""
    context = _ACTIVE.get()
    if context is None or context.axis_name is None or context.device_rng is not None:  # the built-in step's: folded
        return rng
    return jax.random.fold_in(rng, jax.lax.axis_index(context.axis_name))


def _describe(value: object) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}: ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__ if not isinstance(value, (np.ndarray, jax.Array)) else f"an array {value.shape}"
