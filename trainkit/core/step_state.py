"""The state a ``train_step`` / ``test_step`` of the user's own receives: the
:class:`~trainkit.core.state.TrainState` plus, as static fields, the facts of the strategy
that traces the step (the device axis, the optimizer and its groups, the frozen parameters, the
model). Its helpers read those facts, nothing ambient, as Flax users thread
``state.apply_gradients(grads=...)``:

- ``state.apply(params, model_state, *inputs, rng=, train=, method=None, **keywords)``: the
  model (or its ``method``) under the precision policy and remat;
- ``state.apply_gradients(grads, group=None)``: the optimizer's update of one group (``None``:
  all), gradients summed over the device axis first;
- ``state.mean(values, batch)``, ``state.normal(rng, batch, shape)``, ``state.all_rows(values)``:
  :mod:`trainkit.core.step_helpers` under the step's axis.

>>> import jax, jax.numpy as jnp, optax
>>> from trainkit.core.trainable import Trainable
>>> tx = optax.sgd(0.1)
>>> facts = StepFacts(axis_name=None, optimizer=tx, groups=None, trainable=Trainable(None))
>>> state = StepState.create(params=jnp.ones(()), opt_state=tx.init(jnp.ones(())), model_state={}, seed=0)
>>> state = state.replace(facts=facts).apply_gradients(jnp.ones(()))
>>> round(float(state.params), 3), state.facts is facts
(0.9, True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

from trainkit.core import step_helpers
from trainkit.core.checks import SettingError
from trainkit.core.optimizer_groups import OptimizerGroups
from trainkit.core.state import Batch, TrainState, check_tree_matches
from trainkit.core.trainable import Trainable
from trainkit.core.tree import PyTree

#: ``(params, model_state, x, *, rng, train, method) -> (outputs, new_model_state)``
ModelCall = Callable[..., tuple[PyTree, PyTree]]
#: ``(method, positional inputs, keyword inputs) -> x`` as the model's adapter takes it
BindInputs = Callable[[str | None, tuple[PyTree, ...], dict[str, PyTree]], PyTree]


def _unbound_call(*args: object, **kwargs: object) -> tuple[PyTree, PyTree]:
    raise RuntimeError("This StepState was made without a model: state.apply is for a step trainkit traces.")


def _one_input(method: str | None, inputs: tuple[PyTree, ...], keywords: dict[str, PyTree]) -> PyTree:
    if len(inputs) != 1 or keywords:
        raise TypeError("This StepState was made without a model: pass one input.")
    return inputs[0]


class UpdateRecord:
    """The groups ``apply_gradients`` updated while one step is traced (``None``: every group), in
    order: what the step's return is checked against (an update thrown away is named); and, in the
    step :mod:`trainkit.program.step_audit` runs once (``zero_gradients`` given), for each group an
    update read whether all its gradients were zero, sent to that list by a host callback as the
    step runs: from inside a ``fori_loop``, ``scan`` or ``cond`` too (a traced flag kept here would
    leak out of the loop's trace). Steps that are not audited compute nothing for it."""

    def __init__(self, zero_gradients: list[tuple[str, bool]] | None = None) -> None:
        self.groups: list[str | None] = []
        self.zero_gradients = zero_gradients

    def note_gradients(self, facts: StepFacts, params: PyTree, grads: PyTree, group: str | None) -> None:
        if self.zero_gradients is None:
            return
        found = self.zero_gradients
        names: tuple[str | None, ...] = (group,) if group is not None or facts.groups is None else facts.groups.names
        for name in names:
            flags = jax.tree.leaves(group_mask(facts, params, name))
            zero = [jnp.all(g == 0) for g, f in zip(jax.tree.leaves(grads), flags) if f]
            if zero:
                label = "the parameters" if name is None else name
                jax.debug.callback(lambda flag, label=label: found.append((label, bool(flag))), jnp.stack(zero).all())

    def add(self, group: str | None, has_groups: bool) -> None:
        named = [g for g in self.groups if g is not None]
        if has_groups and ((group is None and named) or (group is not None and None in self.groups)):
            earlier = f"group={named[0]!r}" if group is None else "no group"
            raise SettingError(
                f"state.apply_gradients(grads{'' if group is None else f', group={group!r}'}) after "
                f"state.apply_gradients(..., {earlier}) in the same step: an update without group= updates every "
                "group, the ones updated before included, on this loss's gradients (zero where the loss does not "
                "read a group, and Adam still moves those parameters). Name the group each update is for, e.g. "
                "state.apply_gradients(grads, group='generator')."
            )
        self.groups.append(group)


@dataclasses.dataclass(frozen=True, eq=False)  # compared by identity: a static pytree field
class StepFacts:
    """What the helpers need of the step being traced: the device axis (``pmap``; ``None`` under
    ``jit``), the whole optimizer (frozen leaves included), its groups (``None``: one optimizer),
    which parameters train, the model's call, and the updates recorded so far."""

    axis_name: str | None
    optimizer: optax.GradientTransformation
    groups: OptimizerGroups | None
    trainable: Trainable
    call_model: ModelCall = _unbound_call
    bind_inputs: BindInputs = _one_input
    updates: UpdateRecord = dataclasses.field(default_factory=UpdateRecord)

    def for_one_trace(self, zero_gradients: list[tuple[str, bool]] | None = None) -> StepFacts:
        """These facts with an empty record (one per trace of the step; ``zero_gradients``: the
        audit's list, see :class:`UpdateRecord`)."""
        return dataclasses.replace(self, updates=UpdateRecord(zero_gradients))


@flax.struct.dataclass
class StepState(TrainState):
    """A :class:`TrainState` with the step's facts (a static field) and the helpers reading them."""

    facts: StepFacts = flax.struct.field(pytree_node=False, default=None)  # type: ignore[assignment]

    @classmethod
    def of(cls, state: TrainState, facts: StepFacts) -> StepState:
        return cls(**_fields(state), facts=facts)

    def plain(self) -> TrainState:
        """The :class:`TrainState` without the facts (what trainkit keeps)."""
        return TrainState(**_fields(self))

    def apply(
        self, params: PyTree, model_state: PyTree, *inputs: PyTree, rng: jax.Array, train: bool,
        method: str | None = None, **keywords: PyTree,
    ) -> tuple[PyTree, PyTree]:  # fmt: skip
        """``(outputs, new_model_state)`` of the model's ``__call__`` (or ``method``, by name) on
        ``inputs`` (several: as positional arguments; ``keywords`` by name), under the precision
        policy and remat; under a device axis the ``rng`` is folded with the device's index
        (dropout masks differ between devices, as in the built-in step)."""
        x = self.facts.bind_inputs(method, inputs, keywords)
        axis = self.facts.axis_name
        rng = rng if axis is None else jax.random.fold_in(rng, jax.lax.axis_index(axis))
        try:
            return self.facts.call_model(params, model_state, x, rng=rng, train=train, method=method)
        except Exception as error:  # a note added, the error itself re-raised
            if method is None:
                shapes = jax.tree.map(jnp.shape, list(inputs))
                error.add_note(
                    f"state.apply(...) ran the model's __call__ (method=None) on inputs of shapes {shapes}. To run "
                    "another of its methods (a generator, an encoder), pass method='<its name>'."
                )
            raise

    def apply_gradients(
        self, grads: PyTree, group: str | None = None, *, allow_zero_gradients: bool = False
    ) -> StepState:
        """This state with the optimizer's update from ``grads`` (shaped as ``state.params``, or as
        ``state.params[group]`` for a group that is a top-level sub-tree) applied to ``group``'s
        parameters and optimizer state (``None``: every group); frozen parameters and the other
        groups untouched, bit for bit. Under a device axis the gradients are averaged over it first,
        as pmap's data parallelism does (:meth:`mean`'s gradients are scaled for it; a ``jnp.mean``
        over each device's rows gives the one-device gradient too, wherever no row pads).
        ``allow_zero_gradients``: gradients that are all zero on purpose (a generator's warm-up, a
        zero-initialised head) are not refused as a loss that never reads the group."""
        facts = self.facts
        if group is not None and facts.groups is None:
            raise SettingError(
                f"state.apply_gradients(grads, group={group!r}) updates one optimizer group, but the trainer has one "
                "optimizer. Give one per sub-network, optimizer={'generator': ..., 'discriminator': ...}, or pass "
                "group=None."
            )
        if group is not None:
            assert facts.groups is not None
            facts.groups.require(group)
        grads = _whole_tree(self.params, grads, group)
        facts.updates.add(group, facts.groups is not None)
        if facts.axis_name is not None:
            grads = _averaged(grads, self.params, facts, group)
        if not allow_zero_gradients:
            facts.updates.note_gradients(facts, self.params, grads, group)
        with jax.named_scope("apply_gradients" if group is None else f"apply_gradients_{group}"):
            if group is None:
                updates, opt_state = facts.optimizer.update(grads, self.opt_state, self.params)
                return self.replace(params=facts.trainable.apply_updates(self.params, updates), opt_state=opt_state)
            assert facts.groups is not None
            params, opt_state = facts.groups.update(self.params, self.opt_state, grads, group, facts.trainable.trains)
            return self.replace(params=params, opt_state=opt_state)

    def mean(self, values: jax.Array, batch: Batch) -> jax.Array:
        """The mean of per-row ``values`` over the global batch's real rows, weighted by
        ``sample_weight`` (:func:`~trainkit.core.step_helpers.mean`): never ``jnp.mean``, which
        counts the rows that pad the last batch."""
        return step_helpers.mean(values, batch, self.facts.axis_name)

    def normal(
        self, rng: jax.Array, batch: Batch, shape: tuple[int, ...] = (), dtype: DTypeLike = jnp.float32
    ) -> jax.Array:
        """``(rows, *shape)`` standard-normal draws keyed by each row's place in the global batch:
        the same on every strategy and device count (a GAN's ``z``)."""
        if not isinstance(batch, dict) or "mask" not in batch:
            raise TypeError(
                f"state.normal(rng, batch, shape) takes the step's batch second (its rows key the draws, so they are "
                f"the same on any device count); received {type(batch).__name__} {batch!r:.60}. Call "
                "state.normal(rng, batch, (latent_dim,)), e.g. z = state.normal(rng, batch, (64,))."
            )
        return step_helpers.normal(rng, batch, shape, dtype, self.facts.axis_name)

    def shuffled(self, values: PyTree, rng: jax.Array, batch: Batch) -> PyTree:
        """Per-row ``values`` of each row's partner under one permutation of the global batch drawn
        from ``rng`` (MixUp's, CutMix's partners): ``jax.random.permutation`` over the whole batch,
        the same on every strategy and device count (over each device's rows it would not be)."""
        return step_helpers.shuffled(values, rng, batch, self.facts.axis_name)

    def all_rows(self, values: PyTree) -> PyTree:
        """The global batch's rows of per-row ``values`` (an all-gather under a device axis);
        ``state.all_rows(batch["mask"])`` marks the padded ones."""
        return step_helpers.all_rows(values, self.facts.axis_name)


def _fields(state: TrainState) -> dict[str, Any]:
    return {
        "step": state.step, "params": state.params, "opt_state": state.opt_state, "model_state": state.model_state,
        "rng": state.rng, "loss_scale": state.loss_scale, "spikes": state.spikes,
    }  # fmt: skip


def _whole_tree(params: PyTree, grads: PyTree, group: str | None) -> PyTree:
    """``grads`` as the whole parameter tree: a group's own sub-tree (``params[group]``) is put in
    its place, zeros elsewhere (never read: the update reads the group's leaves alone)."""
    if group is not None and isinstance(params, dict) and group in params:
        own = str(jax.tree.structure(params[group]))
        if str(jax.tree.structure(grads)) == own and str(jax.tree.structure(params)) != own:
            zeros = {key: jax.tree.map(jnp.zeros_like, value) for key, value in params.items() if key != group}
            grads = {**zeros, group: grads}
    where = "state.apply_gradients(grads): grads" + ("" if group is None else f" (for group={group!r})")
    fix = "Differentiate with respect to state.params (jax.grad(loss_fn)(state.params)): the whole tree"
    fix += "" if group is None else f", or state.params[{group!r}] where the group is that sub-tree"
    check_tree_matches(where, params, grads, fix=fix + ".")
    return grads


def _averaged(grads: PyTree, params: PyTree, facts: StepFacts, group: str | None) -> PyTree:
    """The gradients of the leaves the update reads averaged over the device axis (one all-reduce;
    the frozen leaves and other groups' are left as they are: nothing reads them)."""
    assert facts.axis_name is not None
    leaves, treedef = jax.tree.flatten(grads)
    flags = jax.tree.leaves(group_mask(facts, params, group))
    averaged = iter(jax.lax.pmean([g for g, f in zip(leaves, flags) if f], facts.axis_name))
    return jax.tree.unflatten(treedef, [next(averaged) if f else g for g, f in zip(leaves, flags)])


def group_mask(facts: StepFacts, params: PyTree, group: str | None) -> PyTree:
    """``True`` at the leaves ``apply_gradients(..., group)`` updates (``None``: every trained leaf)."""
    if facts.groups is None or group is None:
        return facts.trainable.mask(params)
    return jax.tree.map(lambda label: label == group, facts.groups.labels(params, facts.trainable.trains))
