"""A train step of the user's own (``Trainer.train_step(state, batch, rng) -> (state, logs)``)
as the step every strategy compiles and fuses. The user's step receives a
:class:`~trainkit.core.step_state.StepState` (its helpers read the strategy's facts from it)
and a :class:`~trainkit.core.watched_batch.WatchedBatch`; what it returns is checked when it is
traced: the same parameter and optimizer-state structure, no model-state key the model did not
declare, the dtypes kept, and no update computed and thrown away. The step count advances and
the logs (scalars) become metrics weighted by the step's real rows, as the built-in logs are.

>>> import jax, jax.numpy as jnp, optax
>>> from trainkit.core.state import TrainState
>>> from trainkit.core.trainable import Trainable
>>> def step(state, batch, rng):
...     def loss_fn(params):
...         return state.mean((batch["x"] * params - batch["y"]) ** 2, batch)
...     loss, grads = jax.value_and_grad(loss_fn)(state.params)
...     return state.apply_gradients(grads), {"loss": loss}
>>> tx = optax.sgd(0.1)
>>> facts = StepFacts(axis_name=None, optimizer=tx, groups=None, trainable=Trainable(None))
>>> state = TrainState.create(params=jnp.zeros(()), opt_state=tx.init(jnp.zeros(())), model_state={}, seed=0)
>>> batch = {"x": jnp.ones((4,)), "y": jnp.full((4,), 2.0), "mask": jnp.array([1.0, 1, 1, 0])}
>>> state, metrics = make_custom_train_step(step, facts)(state, batch)
>>> int(state.step), round(float(state.params), 3), float(metrics["loss"].compute())
(1, 0.4, 4.0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainkit.core import tree
from trainkit.core.checks import SettingError
from trainkit.core.sown import split_sown
from trainkit.core.state import Batch, TrainState, check_tree_matches
from trainkit.core.step_helpers import pmean_floats
from trainkit.core.step_state import StepFacts, StepState, group_mask
from trainkit.core.totals import LossAverage
from trainkit.core.watched_batch import RowFacts, WatchedBatch

#: ``train_step(state, batch, rng) -> (state, logs)``
UserTrainStep = Callable[[StepState, Batch, jax.Array], tuple[TrainState, dict[str, jax.Array]]]
#: ``test_step(state, batch, rng) -> logs``
UserTestStep = Callable[[StepState, Batch, jax.Array], dict[str, jax.Array]]


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
            "with state.mean(values, batch))."
        )
    return {k: jnp.asarray(v, jnp.float32) for k, v in logs.items()}


def _step_metrics(logs: dict[str, jax.Array], batch: Batch, axis: str | None) -> dict[str, LossAverage]:
    """Each log weighted by the step's real rows (an epoch's log: the mean of its steps' logs
    weighted by their rows, as the built-in logs are); under a device axis averaged over it first,
    exactly itself where every device has the same (``state.mean``'s), per-device means (a
    ``jnp.mean`` over each device's rows) averaged as their gradients are."""
    rows = batch["mask"].sum()
    if axis is not None:
        rows, logs = jax.lax.psum(rows, axis), {name: pmean_floats(value, axis) for name, value in logs.items()}
    return {name: LossAverage(total=value * rows, count=rows) for name, value in logs.items()}


def make_custom_train_step(
    user_step: UserTrainStep, facts: StepFacts, zero_gradients: list[tuple[str, bool]] | None = None
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, LossAverage]]]:
    """The user's ``train_step`` as the step every strategy compiles: its ``rng`` is the state's
    folded with the step number (the same on every device), its returned state checked against
    the one it was given (:func:`check_returned`), its step count advanced, its model state
    averaged over the device axis (batch statistics), its logs weighted by the real rows.
    ``zero_gradients``: the audit's list, to which each update appends, as it runs, its group and
    whether every gradient it read was zero (:mod:`trainkit.program.step_audit`)."""

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, LossAverage]]:
        return _run_user_step(user_step, facts, state, batch, zero_gradients)

    return train_step


def _run_user_step(
    user_step: UserTrainStep,
    facts: StepFacts,
    state: TrainState,
    batch: Batch,
    zero_gradients: list[tuple[str, bool]] | None,
) -> tuple[TrainState, dict[str, LossAverage]]:
    axis = facts.axis_name
    rng = jax.random.fold_in(state.rng, state.step)
    traced = facts.for_one_trace(zero_gradients)
    with jax.named_scope("train_step"):  # the user's step, its updates named within (apply_gradients/<group>)
        result = user_step(StepState.of(state, traced), WatchedBatch.of(batch, RowFacts(axis)), rng)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], TrainState)):
        raise TypeError(
            "train_step(self, state, batch, rng) must return (state, logs): the new state (from "
            "state.apply_gradients(grads, ...) or state.replace(...)) and a dict of scalar logs; received "
            f"{_describe(result)}."
        )
    new_state, logs = result
    check_returned(state, new_state, traced)
    model_state = split_sown(new_state.model_state)[0]  # losses the model sowed are each call's, not state
    if axis is not None:
        model_state = jax.tree.map(lambda v: pmean_floats(v, axis), model_state)
    kept = new_state.plain() if isinstance(new_state, StepState) else new_state
    kept = kept.replace(
        step=state.step + 1, rng=state.rng, loss_scale=state.loss_scale, spikes=state.spikes, model_state=model_state
    )
    return kept, _step_metrics(_checked_logs(logs, "train_step"), batch, axis)


def check_returned(given: TrainState, returned: TrainState, facts: StepFacts) -> None:
    """Refuses, when the step is traced, a returned state that would train silently wrong: other
    parameter or optimizer-state structures, parameters or model state in another dtype, model
    state the model did not declare, and an update ``apply_gradients`` computed whose parameters
    or optimizer state were not returned (``state.apply_gradients(...)`` without ``state =``)."""
    fix = "Return the state the step threaded: state = state.apply_gradients(grads, ...); return state, logs."
    check_tree_matches("The state train_step returned: its params", given.params, returned.params, fix=fix)
    if str(jax.tree.structure(returned.opt_state)) != str(jax.tree.structure(given.opt_state)):
        raise SettingError(
            "The state train_step returned has another optimizer state structure than the one it was given: "
            "update it only through state.apply_gradients(grads, group=...)."
        )
    declared, kept = split_sown(given.model_state)[0], split_sown(returned.model_state)[0]
    added = sorted(set(tree.signature(kept)) - set(tree.signature(declared)))
    if added:
        raise SettingError(
            f"train_step returned model_state with {added[:5]}, which the model never declared: trainkit keeps only "
            "the model's own variables, so they would be dropped. Keep extra state where it is checkpointed and "
            "sharded (docs/custom_training.md, 'State of your own'): a frozen sub-module's parameters (an EMA "
            "target) or a variable the model declares (self.variable('queue', ...))."
        )
    for part, before, after in (("params", given.params, returned.params), ("model_state", declared, kept)):
        changed = tree.difference(part, tree.signature(before), tree.signature(after), names=("given", "returned"))
        if changed:
            raise SettingError(
                f"train_step returned {part} in another dtype than it was given: {changed[:3]}. The state keeps "
                "its dtypes (the precision policy casts for the computation alone): .astype(...) the value back, "
                "or compute it from the float32 parameters."
            )
    _check_updates_kept(given, returned, facts)


def _check_updates_kept(given: TrainState, returned: TrainState, facts: StepFacts) -> None:
    for group in dict.fromkeys(facts.updates.groups):
        flags = jax.tree.leaves(group_mask(facts, given.params, group))
        pairs = [(a, b) for a, b, f in zip(jax.tree.leaves(given.params), jax.tree.leaves(returned.params), flags) if f]
        given_opt, returned_opt = _group_opt_state(given, facts, group), _group_opt_state(returned, facts, group)
        dropped = "parameters" if pairs and all(a is b for a, b in pairs) else None
        if dropped is None and given_opt and all(a is b for a, b in zip(given_opt, returned_opt)):
            dropped = "optimizer state"
        if dropped is not None:
            name = "every group" if group is None else f"group {group!r}"
            call = "grads" if group is None else f"grads, group={group!r}"
            raise SettingError(
                f"train_step computed an update of {name} (state.apply_gradients({call})) but returned the {dropped} "
                "it was given: the update was thrown away, so it would never train. Keep what apply_gradients "
                f"returns and return it: state = state.apply_gradients({call}); ...; return state, logs."
            )


def _group_opt_state(state: TrainState, facts: StepFacts, group: str | None) -> list[Any]:
    if group is None or facts.groups is None:
        return jax.tree.leaves(state.opt_state)
    return jax.tree.leaves(facts.groups.inner_state(state.opt_state, group))


def make_custom_eval_step(
    user_step: UserTestStep, facts: StepFacts
) -> Callable[[TrainState, Batch], dict[str, LossAverage]]:
    """The user's ``test_step`` as the eval step (its logs weighted by the real rows)."""

    def eval_step(state: TrainState, batch: Batch) -> dict[str, LossAverage]:
        watched = WatchedBatch.of(batch, RowFacts(facts.axis_name))
        logs = user_step(StepState.of(state, facts.for_one_trace()), watched, state.rng)
        return _step_metrics(_checked_logs(logs, "test_step"), batch, facts.axis_name)

    return eval_step


def _describe(value: object) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}: ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__ if not isinstance(value, (np.ndarray, jax.Array)) else f"an array {value.shape}"
