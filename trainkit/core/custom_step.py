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

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from trainkit.core import tree
from trainkit.core.checks import SettingError
from trainkit.core.override_step import OverrideStep
from trainkit.core.sown import split_sown
from trainkit.core.state import Batch, TrainState, check_tree_matches
from trainkit.core.step_helpers import pmean_floats
from trainkit.core.step_state import StepFacts, StepState, group_mask
from trainkit.core.step_value import Step, checked_step
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


class Overrides(NamedTuple):
    """Which of a trainer's override points its class overrides (:func:`overrides`)."""

    compute_loss: bool
    train_step: bool
    #: a ``test_step`` of its own, or none to evaluate by (a ``train_step`` of its own, no loss)
    test_step: bool
    #: a step value was given (``Trainer(step=...)``)
    step: bool = False

    @property
    def loss(self) -> bool:
        """The loss is the user's (``compute_loss``, ``train_step`` or a step value): ``loss=`` may be left out."""
        return self.compute_loss or self.train_step or self.step


class Overridable(Protocol):
    """A trainer class as :func:`overrides` reads it: its override points."""

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any: ...

    def train_step(self, *args: Any, **kwargs: Any) -> Any: ...

    def test_step(self, *args: Any, **kwargs: Any) -> Any: ...


def overrides(cls: type[Overridable], base: type[Overridable], *, has_loss: bool, step: object = None) -> Overrides:
    """What ``cls`` (a ``Trainer`` subclass) overrides of ``base`` (``Trainer``): raises for a
    ``train_step`` / ``test_step`` of the wrong signature (:func:`overridden`); ``has_loss``:
    ``loss=`` was given (else a ``train_step`` of its own evaluates by its ``test_step``);
    ``step``: the ``step=`` given (a value replacing the built-in step)."""
    train = overridden(cls.train_step, base.train_step, cls.__name__)
    test = overridden(cls.test_step, base.test_step, cls.__name__)
    own_loss = cls.compute_loss is not base.compute_loss
    return Overrides(own_loss, train, test or (train and not has_loss and not own_loss), step is not None)


def step_of(owner: Overridable, own: Overrides, step: object) -> Step | None:
    """The step value a trainer runs: ``step`` (``Trainer(step=...)``, checked), the adapter of
    its ``train_step`` / ``test_step`` overrides, or ``None`` (the built-in step)."""
    if step is not None:
        if own.train_step or own.test_step:
            raise TypeError(
                f"{type(owner).__name__} overrides train_step or test_step and was given step= too: one step runs. "
                "Keep the override, or move it into the tk.Step (its train / test methods) and drop the override."
            )
        return checked_step(step)
    if own.train_step or own.test_step:
        return OverrideStep(owner, trains_own=own.train_step, tests_own=own.test_step)
    return None


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
            f"{name}(self, state, batch, rng) -> {returns}: state a StepState (state.params, state.opt_state, "
            "state.model_state), batch a dict ('x', 'y', 'mask', maybe 'sample_weight'), rng this step's key. "
            "Keras's train_step(self, state, data) / train_step(self, data) map onto it as docs/custom_training.md "
            "shows (gradients through state.apply_gradients(grads), losses through state.mean(values, batch))."
        )
    return True


def not_callable(name: str) -> NotImplementedError:
    """What calling the default ``train_step`` / ``test_step`` raises: ``super().train_step(...)``,
    or an evaluation of a trainer whose own ``train_step`` has no loss to evaluate by."""
    if name == "test_step":
        return NotImplementedError(
            "evaluate and validation run test_step(self, state, batch, rng) -> logs, and this trainer has a "
            "train_step of its own but neither loss= nor compute_loss for the built-in evaluation: override "
            "test_step (e.g. return {'d_loss': state.mean(per_row, batch)}), or pass loss=... ."
        )
    return NotImplementedError(
        "Trainer.train_step has no body to call: without an override trainkit runs its built-in step (compute_loss, "
        "the optimizer, the metrics) directly. In an override, compute the loss with self.compute_loss(...) or "
        "state.apply(...) and state.mean(...), and update with state = state.apply_gradients(grads)."
    )


def _describe(value: object) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}: ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__ if not isinstance(value, (np.ndarray, jax.Array)) else f"an array {value.shape}"
