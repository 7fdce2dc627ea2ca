"""A pipeline over a ``stage`` mesh axis: the model's stacked blocks split into stages, each
microbatch passed from stage to stage (``Hybrid(data=2, stage=4, microbatches=8)``).

The model is not edited. While a training step is traced with a :class:`~trainkit.strategies.gpipe.Schedule`
in its trace context (:mod:`trainkit.core.trace_context`), the model's
forward pass (:func:`staged`) is traced once at one microbatch's rows and split at its stacked
blocks: the one ``lax.scan`` over the layers (what ``nn.scan``, ``nnx.scan`` or a hand-written
scan over stacked parameters becomes). What comes before it (the embedding) and after it (the
head) runs for every microbatch (``jax.vmap``); the scan itself runs as a GPipe schedule
(:mod:`trainkit.strategies.gpipe`): stage ``s`` holds layers ``s*L/S`` to ``(s+1)*L/S`` (the stacked
parameters sharded along their layer axis) and works on microbatch ``t - s`` at tick ``t``. The
numbers are those of the whole batch through the plain model: every row computes the same
operations; only which rows share a matrix product changes.

What the layers scan over must be the parameters alone, its carry the activations, and it may
return nothing per layer (``nn.scan``'s ``ys`` unused); with dropout each microbatch draws from
its own key (``fold_in(rng, microbatch)``), so masks differ from one device's.

>>> bubble_fraction(stages=4, microbatches=8)  # GPipe: (S - 1) / (M + S - 1)
0.2727...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar, cast

import jax
import jax.numpy as jnp

from trainkit.core.trace_context import current
from trainkit.core.tree import Apply, PyTree, leaf_name
from trainkit.internals import jaxpr as jcore
from trainkit.strategies.gpipe import Layer, Schedule, gpipe

P = ParamSpec("P")
R = TypeVar("R")

#: the repeated blocks the pipeline splits: one ``lax.scan`` over stacked parameters (linen's ``nn.scan``)
HOW_TO_STACK = (
    "stack the repeated blocks into one module whose parameters have a leading layer axis, e.g. "
    "nn.scan(Block, variable_axes={'params': 0}, split_rngs={'params': True}, length=layers)"
)


def bubble_fraction(*, stages: int, microbatches: int) -> float:
    """The fraction of a GPipe step each stage waits: ``(S - 1) / (M + S - 1)``."""
    return (stages - 1) / (microbatches + stages - 1)


class NotPipelined(ValueError):
    """The model cannot be split into stages (the reason says why and what to do)."""


def staged(apply: Apply) -> Apply:
    """``apply`` run as a pipeline while a step is traced with a schedule in its context and the
    rows divide into its microbatches (else, e.g. a predict batch of another size, as it is: the
    same numbers, the compiler gathering the stacked parameters)."""

    def run(
        params: PyTree, model_state: PyTree, x: PyTree, *, rng: jax.Array | None, train: bool, **options: PyTree
    ) -> tuple[PyTree, PyTree]:
        schedule = current(Schedule)
        rows = None if schedule is None else _rows(x)  # no schedule: nothing read (an export's symbolic batch)
        if schedule is None or rows is None or rows % schedule.microbatches:
            return apply(params, model_state, x, rng=rng, train=train, **options)

        def call(params: PyTree, model_state: PyTree, x: PyTree, rng: jax.Array | None) -> tuple[PyTree, PyTree]:
            return apply(params, model_state, x, rng=rng, train=train, **options)

        return _run_pipelined(call, (params, model_state), x, rng, schedule)

    return run


def stacked_parameters(apply: Apply, params: PyTree, model_state: PyTree, x: PyTree, stages: int) -> list[str]:
    """The paths (``"ScanBlock_0/Dense_0/kernel"``) of the stacked blocks' parameters a
    ``stages``-stage pipeline splits along their layer axis; raises :class:`NotPipelined` with the
    reason when the model has no such blocks or their layers do not divide into the stages."""

    def call(params: PyTree, model_state: PyTree, x: PyTree) -> tuple[PyTree, PyTree]:
        return apply(params, model_state, x, rng=jax.random.PRNGKey(0), train=True)

    closed = jax.make_jaxpr(call)(params, model_state, x)
    shared = len(jax.tree.leaves((params, model_state)))
    split = _Split.of(closed.jaxpr, shared_inputs=shared, stages=stages)
    names = [leaf_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    return sorted({names[i] for i in split.stacked_inputs() if i < len(names)})


def _rows(x: PyTree) -> int | None:
    leaves = [leaf for leaf in jax.tree.leaves(x) if jnp.ndim(leaf)]
    return int(jnp.shape(leaves[0])[0]) if leaves else None


# ---------------------------------------------------------------------- the split forward pass
def _nbytes(var: jcore.Atom) -> int:
    aval = cast(jax.core.ShapedArray, var.aval)
    return int(aval.size) * int(aval.dtype.itemsize)


def _shape(var: jcore.Var) -> tuple[int, ...]:
    return tuple(cast(jax.core.ShapedArray, var.aval).shape)


@dataclasses.dataclass
class _Split:
    """A forward pass's jaxpr split at its stacked blocks' scan (``eqns[scan]``): ``rows`` are
    the variables that differ from microbatch to microbatch (they depend on the inputs' rows)."""

    jaxpr: jcore.Jaxpr
    scan: int
    rows: set[jcore.Var]

    @classmethod
    def of(cls, jaxpr: jcore.Jaxpr, *, shared_inputs: int, stages: int) -> _Split:
        rows = set(jaxpr.invars[shared_inputs:])
        candidates: list[tuple[int, int]] = []  # (stacked bytes, eqn index)
        for index, eqn in enumerate(jaxpr.eqns):
            uses = [v for v in eqn.invars if jcore.is_var(v)]
            if eqn.primitive.name == "scan" and not eqn.params["reverse"]:
                consts, carry = jcore.scan_counts(eqn)
                xs = eqn.invars[consts + carry :]
                shared_xs = [v for v in xs if not (jcore.is_var(v) and v in rows)]  # the layers' parameters
                if shared_xs and any(v in rows for v in eqn.invars[consts : consts + carry]):
                    candidates.append((sum(_nbytes(v) for v in shared_xs), index))
            if any(v in rows for v in uses):
                rows.update(eqn.outvars)
        if not candidates:
            raise NotPipelined(
                "a pipeline needs the model's repeated blocks stacked into one scan over their layers, "
                f"and this model has none: {HOW_TO_STACK}."
            )
        _, scan = max(candidates)
        length = jaxpr.eqns[scan].params["length"]
        if length % stages:
            raise NotPipelined(
                f"the stacked blocks have {length} layers, which do not divide into {stages} stages: choose a "
                f"stage count that divides {length}, or a layer count that is a multiple of {stages}."
            )
        split = cls(jaxpr, scan, rows)
        split.check_outputs()
        return split

    @property
    def eqn(self) -> jcore.JaxprEqn:
        return self.jaxpr.eqns[self.scan]

    def needed(self) -> set[jcore.Var]:
        used = {v for eqn in self.jaxpr.eqns for v in eqn.invars if jcore.is_var(v)}
        return used | {v for v in self.jaxpr.outvars if jcore.is_var(v)}

    def check_outputs(self) -> None:
        _, carry = jcore.scan_counts(self.eqn)
        needed = self.needed()
        if any(v in needed for v in self.eqn.outvars[carry:]):
            raise NotPipelined(
                "the stacked blocks' scan returns values per layer (nn.scan's ys) that the model uses; a "
                "pipeline passes only the carry (the activations) from stage to stage. Return None per layer."
            )

    def stacked_inputs(self) -> list[int]:
        """Indices of the jaxpr's inputs the scan takes as its stacked operands (through dtype casts)."""
        made_by = {v: eqn for eqn in self.jaxpr.eqns for v in eqn.outvars}
        found = []
        start = sum(jcore.scan_counts(self.eqn))
        for atom in self.eqn.invars[start:]:
            while jcore.is_var(atom) and atom in made_by and made_by[atom].primitive.name == "convert_element_type":
                atom = made_by[atom].invars[0]
            if jcore.is_var(atom) and atom in self.jaxpr.invars:
                found.append(self.jaxpr.invars.index(atom))
        return found


def _evaluate(
    eqns: Sequence[jcore.JaxprEqn], env: dict[jcore.Var, PyTree], needed: set[jcore.Var], rows: set[jcore.Var] | None
) -> None:
    """Runs ``eqns`` (in order) on the values in ``env`` and adds what they make that is
    ``needed``; with ``rows``, over the microbatches (``jax.vmap``; those inputs lead with it)."""
    if not eqns:
        return
    made = [v for eqn in eqns for v in eqn.outvars]
    made_set = set(made)
    inputs = list(dict.fromkeys(v for eqn in eqns for v in eqn.invars if jcore.is_var(v) and v not in made_set))
    outputs = [v for v in made if v in needed]
    fn = jcore.function_of(eqns, inputs, outputs, "pipeline")
    if rows is not None:
        fn = jax.vmap(fn, in_axes=[0 if v in rows else None for v in inputs])
    env.update(zip(outputs, fn(*[env[v] for v in inputs])))


def _read(env: dict[jcore.Var, PyTree], atom: jcore.Atom) -> PyTree:
    if jcore.is_literal(atom):
        return atom.val
    return env[atom]


def _split_rows(a: jax.Array, microbatches: int) -> jax.Array:
    """``(B, ...)`` -> ``(M, B/M, ...)``: microbatch ``j`` holds rows ``j, j+M, ...``, so every
    microbatch takes rows from every data shard (a contiguous block of the batch)."""
    return jnp.swapaxes(a.reshape(a.shape[0] // microbatches, microbatches, *a.shape[1:]), 0, 1)


def _merge_rows(a: jax.Array) -> jax.Array:
    return jnp.swapaxes(a, 0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def _run_pipelined(
    call: Callable[..., tuple[PyTree, PyTree]], shared: PyTree, x: PyTree, rng: jax.Array | None, schedule: Schedule
) -> tuple[PyTree, PyTree]:
    """``call(*shared, x, rng)`` with its stacked blocks run by ``schedule`` (see the module)."""
    m = schedule.microbatches
    micro_x = jax.tree.map(lambda a: _split_rows(jnp.asarray(a), m), x)
    micro_rng = None if rng is None else jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(m))
    first = jax.tree.map(lambda a: a[0], (micro_x, micro_rng))
    closed, out_shape = jax.make_jaxpr(call, return_shape=True)(*shared, *first)
    jaxpr = closed.jaxpr
    shared_leaves = jax.tree.leaves(shared)
    split = _Split.of(jaxpr, shared_inputs=len(shared_leaves), stages=schedule.stages)
    needed = split.needed()
    env: dict[jcore.Var, PyTree] = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, shared_leaves + jax.tree.leaves((micro_x, micro_rng))))
    others = [eqn for i, eqn in enumerate(jaxpr.eqns) if i != split.scan]
    _evaluate([eqn for eqn in others if not any(v in split.rows for v in eqn.outvars)], env, needed, None)
    before = [eqn for eqn in jaxpr.eqns[: split.scan] if any(v in split.rows for v in eqn.outvars)]
    _evaluate(before, env, needed, split.rows)
    eqn = split.eqn
    consts, carry = jcore.scan_counts(eqn)
    layer_fn = jcore.scan_body(eqn)
    operands = [_read(env, a) for a in eqn.invars]
    per_micro = [jcore.is_var(a) and a in split.rows for a in eqn.invars[:consts]]
    carried = [
        v if jcore.is_var(a) and a in split.rows else jnp.broadcast_to(v, (m, *jnp.shape(v)))
        for a, v in zip(eqn.invars[consts : consts + carry], operands[consts : consts + carry])
    ]
    stacked_per_micro = [jcore.is_var(a) and a in split.rows for a in eqn.invars[consts + carry :]]
    layer = Layer(lambda c, h, xs: list(layer_fn(*c, *h, *xs))[:carry], per_micro, stacked_per_micro)
    env.update(zip(eqn.outvars[:carry], gpipe(layer, operands[:consts], carried, operands[consts + carry :], schedule)))
    split.rows.update(eqn.outvars[:carry])
    after = [e for e in jaxpr.eqns[split.scan + 1 :] if any(v in split.rows for v in e.outvars)]
    _evaluate(after, env, needed, split.rows)
    rows = jax.tree.leaves(micro_x)[0].shape[1]  # one microbatch's
    for atom in jaxpr.outvars:
        shape = _shape(atom) if jcore.is_var(atom) and atom in split.rows else (rows,)
        if not shape or shape[0] != rows:
            raise NotPipelined(
                f"the model returns a value of shape {shape} that depends on the batch but does not lead with its "
                f"rows ({rows} a microbatch): a pipeline cannot put the microbatches' values back together (a loss "
                "the model sows, batch statistics it updates). Return per-row values, or train without a stage axis."
            )
    outs = [_merge_rows(_read(env, a)) if jcore.is_var(a) and a in split.rows else _read(env, a) for a in jaxpr.outvars]
    result: tuple[PyTree, PyTree] = jax.tree.unflatten(jax.tree.structure(out_shape), outs)
    return result
