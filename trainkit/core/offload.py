"""The optimizer's state kept in host memory and streamed through the update a group of leaves
at a time (``Trainer(offload="optimizer")``), so the device never holds all of it at once.

Which leaves live on the host is one rule, :func:`on_host` (every optimizer-state array of at
least one dimension: moments, traces, EMA copies; counters and injected hyperparameters stay on
the device). The strategy places those leaves in ``pinned_host`` memory; the step moves each
group to the device just before its update and the new values back just after.

A group is found, not assumed: :func:`streamed_update` traces ``tx.update`` once and follows
which outputs read which host leaves. Outputs that read several host leaves join them into one
group (Adam's update of a parameter reads both its moments), so every group's outputs depend
on its own leaves alone, plus what is on the device anyway (gradients, parameters, counters).
Each group is then computed from its own leaves, exactly as the whole update computes it, for
any optax transformation: one whose update of a parameter reads another parameter's state
(a global norm of the moments) simply makes one group. Groups smaller than the largest are
merged up to its size, and an optimisation barrier orders them, so at most about two groups
are on the device at a time.

>>> import jax, jax.numpy as jnp, numpy as np, optax
>>> tx = optax.adam(0.1)
>>> params = {"a": jnp.ones(3), "b": jnp.ones(4)}
>>> grads = {"a": jnp.full(3, 0.5), "b": jnp.full(4, -1.0)}
>>> state = tx.init(params)
>>> [len(group) for group in host_groups(tx, grads, state, params)]  # a's moments, b's moments
[2, 2]
>>> streamed = jax.jit(lambda *args: streamed_update(tx, *args))(grads, state, params)
>>> whole = jax.jit(tx.update)(grads, state, params)
>>> all(map(np.array_equal, jax.tree.leaves(streamed), jax.tree.leaves(whole)))  # the same bits
True
>>> streamed[1][0].mu["a"].sharding.memory_kind  # the new moments are back in host memory
'pinned_host'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
import optax

from trainkit.core.tree import Leaf, PyTree, array_bytes
from trainkit.internals.jaxpr import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var, called_jaxpr, is_literal, is_var

#: The names ``Trainer(offload=...)`` takes.
OFFLOADS = ("optimizer", "optimizer+frozen", "auto")


@dataclasses.dataclass(frozen=True)
class Offload:
    """What lives in host memory: ``optimizer``, the optimizer's state (:func:`on_host` leaves);
    ``frozen``, also the frozen parameters (a LoRA base, ``trainable=``'s others), read by the
    forward pass where it uses them (:func:`to_device`); ``frozen_paths``, which those are, set
    when the model's parameters are known. ``auto``: the plan decides, adding the optimizer's
    offload only when the step does not fit without it (nothing is offloaded until it does: the
    value is false).

    >>> Offload.of("optimizer"), Offload.of(None).optimizer, bool(Offload.of("auto"))
    (Offload(optimizer=True, frozen=False, auto=False), False, False)
    >>> Offload.of("optimizer+frozen").keeping(["Dense_0/kernel"]).frozen_paths
    frozenset({'Dense_0/kernel'})
    """

    optimizer: bool = False
    frozen: bool = False
    auto: bool = False
    frozen_paths: frozenset[str] = dataclasses.field(default=frozenset(), repr=False)

    @classmethod
    def of(cls, value: str | Offload | None) -> Offload:
        """The setting from ``Trainer(offload=...)``: ``None``, ``"optimizer"``, ``"optimizer+frozen"``,
        ``"auto"`` or an ``Offload``."""
        if isinstance(value, Offload):
            return value
        if value is None:
            return cls()
        if value not in OFFLOADS:
            raise ValueError(
                f"offload={value!r} is not a setting. Use offload='optimizer' (the optimizer's state in host memory, "
                "streamed through each update), 'optimizer+frozen' (the frozen parameters too), 'auto' (only when "
                "the step does not fit without it) or None (everything in device memory)."
            )
        return cls(auto=True) if value == "auto" else cls(optimizer=True, frozen=value == "optimizer+frozen")

    def keeping(self, frozen_paths: Sequence[str]) -> Offload:
        """This setting with the paths (``"Dense_0/kernel"``) of the frozen parameters it keeps on the host."""
        return dataclasses.replace(self, frozen_paths=frozenset(frozen_paths)) if self.frozen else self

    def __bool__(self) -> bool:
        return self.optimizer


#: The memory kind offloaded leaves are placed in (JAX's CPU devices have it too).
HOST_MEMORY = "pinned_host"


def in_host_memory(sharding: jax.sharding.Sharding) -> bool:
    """Whether ``sharding`` places its array in host memory (an offloaded leaf)."""
    return sharding.memory_kind == HOST_MEMORY


def to_device(tree: PyTree) -> PyTree:
    """``tree`` with each leaf that is in host memory moved to the device (inside a traced
    function: the compiler streams each one to where it is read, so the device never holds all
    of them at once); any other leaf as it is. What the model's forward pass does with its
    parameters under ``offload="optimizer+frozen"``.

    >>> import jax.numpy as jnp
    >>> host = jax.device_put(jnp.ones(2), jax.memory.Space.Host)
    >>> host.sharding.memory_kind, jax.jit(to_device)([host])[0].sharding.memory_kind
    ('pinned_host', 'device')
    """

    def moved(leaf: Leaf) -> Leaf:
        if isinstance(leaf, jax.Array) and jax.typeof(leaf).memory_space == jax.memory.Space.Host:
            on_device: Leaf = jax.device_put(leaf, jax.memory.Space.Device)
            return on_device
        return leaf

    return jax.tree.map(moved, tree)


def on_host(leaf: Leaf) -> bool:
    """Whether an optimizer-state leaf lives in host memory under offload: every array of at
    least one dimension (a scalar counter or hyperparameter stays on the device).

    >>> on_host(jax.ShapeDtypeStruct((3, 4), "float32")), on_host(jax.ShapeDtypeStruct((), "int32"))
    (True, False)
    """
    return len(np.shape(leaf)) >= 1


def _bits_of(jaxpr: Jaxpr, input_bits: Sequence[int]) -> dict[Var, int]:
    """For every variable of ``jaxpr``, the set (a bit mask) of inputs it reads. A call is
    followed inside (``jit``); any other primitive's outputs read all of its inputs."""
    bits: dict[Var, int] = dict(zip(jaxpr.invars, input_bits, strict=True))

    def read(var: Var | Literal) -> int:
        return 0 if is_literal(var) else bits.get(var, 0)

    for eqn in jaxpr.eqns:
        inner = called_jaxpr(eqn)
        if inner is not None:
            inside = _bits_of(inner, [read(v) for v in eqn.invars])
            outs = [0 if is_literal(v) else inside.get(v, 0) for v in inner.outvars]
        else:
            union = 0
            for var in eqn.invars:
                union |= read(var)
            outs = [union] * len(eqn.outvars)
        bits.update(zip(eqn.outvars, outs, strict=True))
    return bits


@dataclasses.dataclass(frozen=True)
class _Traced:
    """``tx.update`` traced once: its jaxpr, which inputs are host leaves, and the groups."""

    closed: ClosedJaxpr
    out_tree: jax.tree_util.PyTreeDef
    host_inputs: tuple[int, ...]  # positions (in the flat inputs) of the host leaves
    host_outputs: frozenset[int]  # positions (in the flat outputs) of the new state's host leaves
    groups: tuple[tuple[int, ...], ...]  # each: indices into host_inputs
    output_group: tuple[int, ...]  # per flat output: its group, or -1 (reads no host leaf)


def _trace(tx: optax.GradientTransformation, grads: PyTree, opt_state: PyTree, params: PyTree) -> _Traced:
    # traced on device-typed shapes: the host leaves are moved to the device before they are read
    abstract = jax.tree.map(_device_typed, (grads, opt_state, params))
    closed, shapes = jax.make_jaxpr(tx.update, return_shape=True)(*abstract)
    flat_state = jax.tree.leaves(opt_state)
    first = len(jax.tree.leaves(grads))
    host_inputs = tuple(first + i for i, leaf in enumerate(flat_state) if on_host(leaf))
    input_bits = [0] * len(closed.jaxpr.invars)
    for k, position in enumerate(host_inputs):
        input_bits[position] = 1 << k
    bits = _bits_of(closed.jaxpr, input_bits)
    masks = [0 if is_literal(v) else bits.get(v, 0) for v in closed.jaxpr.outvars]
    groups = _joined(len(host_inputs), masks)
    sizes = [sum(_bytes(flat_state[host_inputs[k] - first]) for k in group) for group in groups]
    groups = _merged(groups, sizes)
    group_of = {k: g for g, group in enumerate(groups) for k in group}
    output_group = tuple(group_of[_lowest(mask)] if mask else -1 for mask in masks)
    # the outputs are the updates (one per gradient) then the new state, laid out as the old: a
    # new state leaf sits where its old one sat among the inputs (after the gradients)
    host_outputs = frozenset(host_inputs)
    return _Traced(closed, jax.tree.structure(shapes), host_inputs, host_outputs, tuple(groups), output_group)


def _device_typed(value: Leaf) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(value), value.dtype, weak_type=jax.typeof(value).weak_type)


def _lowest(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


def _joined(count: int, masks: Sequence[int]) -> list[tuple[int, ...]]:
    """The host leaves joined by the outputs that read several of them (union-find), in the
    order of their first leaf."""
    parent = list(range(count))

    def root(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for mask in masks:
        members = [k for k in range(count) if mask >> k & 1]
        for other in members[1:]:
            parent[root(other)] = root(members[0])
    groups: dict[int, list[int]] = {}
    for k in range(count):
        groups.setdefault(root(k), []).append(k)
    return sorted((tuple(members) for members in groups.values()), key=lambda members: members[0])


def _merged(groups: list[tuple[int, ...]], sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Neighbouring groups merged while together no larger than the largest one: fewer steps
    in the chain, and the device never holds much more than the largest group twice."""
    limit = max(sizes, default=0)
    merged: list[tuple[int, ...]] = []
    sizes_merged: list[int] = []
    for group, size in zip(groups, sizes, strict=True):
        if merged and sizes_merged[-1] + size <= limit:
            merged[-1], sizes_merged[-1] = merged[-1] + group, sizes_merged[-1] + size
        else:
            merged.append(group)
            sizes_merged.append(size)
    return merged


def _bytes(leaf: Leaf) -> int:
    return array_bytes(np.shape(leaf), leaf.dtype)


def host_groups(tx: optax.GradientTransformation, grads: PyTree, opt_state: PyTree, params: PyTree) -> list[list[str]]:
    """The groups :func:`streamed_update` moves to the device together, as the names of their
    optimizer-state leaves (for a plan or a test to read)."""
    traced = _trace(tx, grads, opt_state, params)
    first = len(jax.tree.leaves(grads))
    names = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]]
    return [[names[traced.host_inputs[k] - first] for k in group] for group in traced.groups]


def streamed_update(
    tx: optax.GradientTransformation, grads: PyTree, opt_state: PyTree, params: PyTree
) -> tuple[PyTree, PyTree]:
    """``tx.update(grads, opt_state, params)`` with the :func:`on_host` leaves of ``opt_state``
    in host memory: each group moved to the device for its part of the update and its new
    values moved back, one group after another. The same values as ``tx.update`` (the same
    operations on the same inputs); traced into a compiled step (offload refuses
    ``run_eagerly``: op by op, XLA may round a fused operation's parts differently)."""
    traced = _trace(tx, grads, opt_state, params)
    jaxpr, flat = traced.closed.jaxpr, jax.tree.leaves((grads, opt_state, params))
    env: dict[Var, jax.Array] = dict(zip(jaxpr.constvars, traced.closed.consts, strict=True))
    host = set(traced.host_inputs)
    env.update((var, value) for i, (var, value) in enumerate(zip(jaxpr.invars, flat, strict=True)) if i not in host)
    outputs: dict[int, jax.Array] = {}

    def placed(i: int) -> jax.Array:  # output i, a new host leaf moved back to host memory
        value = _read(env, jaxpr.outvars[i])
        return jax.device_put(value, jax.memory.Space.Host) if i in traced.host_outputs else value

    previous: tuple[jax.Array, ...] = ()
    for g, group in enumerate(traced.groups):
        leaves = tuple(flat[traced.host_inputs[k]] for k in group)
        if previous:  # the group's leaves come to the device only once the last group's are back
            leaves, _ = jax.lax.optimization_barrier((leaves, previous))
        for k, value in zip(group, leaves, strict=True):
            env[jaxpr.invars[traced.host_inputs[k]]] = jax.device_put(value, jax.memory.Space.Device)
        wanted = [i for i, group_of in enumerate(traced.output_group) if group_of == g]
        _evaluate(jaxpr, env, [jaxpr.outvars[i] for i in wanted])
        written: list[jax.Array] = []
        for i in wanted:
            outputs[i] = placed(i)
            if i in traced.host_outputs:
                written.append(outputs[i])
        previous = tuple(written)
    rest = [i for i, group_of in enumerate(traced.output_group) if group_of == -1]
    _evaluate(jaxpr, env, [jaxpr.outvars[i] for i in rest])
    for i in rest:
        outputs[i] = placed(i)
    outputs_tree: tuple[PyTree, PyTree] = jax.tree.unflatten(
        traced.out_tree, [outputs[i] for i in range(len(jaxpr.outvars))]
    )
    return outputs_tree


def _read(env: dict[Var, jax.Array], var: Var | Literal) -> jax.Array:
    return var.val if is_literal(var) else env[var]


def _evaluate(jaxpr: Jaxpr, env: dict[Var, jax.Array], wanted: Sequence[Var | Literal]) -> None:
    """Binds, in order, the equations ``wanted`` needs and ``env`` lacks (JAX's own interpreter
    loop, restricted to a slice of the program). A plain call (a ``jit`` inside the update, such
    as optax's bias correction over every moment at once) is followed inside, for the outputs
    wanted only: its other outputs may read leaves of other groups, not on the device yet."""
    needed = {v for v in wanted if is_var(v) and v not in env}
    chosen: list[tuple[JaxprEqn, list[int]]] = []
    for eqn in reversed(jaxpr.eqns):
        outputs = [i for i, v in enumerate(eqn.outvars) if v in needed]
        if not outputs:
            continue
        chosen.append((eqn, outputs))
        inner = called_jaxpr(eqn)
        inputs = range(len(eqn.invars)) if inner is None else _inputs_read(inner, outputs)
        needed.update(v for i in inputs if is_var(v := eqn.invars[i]) and v not in env)
    for eqn, outputs in reversed(chosen):
        inner = called_jaxpr(eqn)
        if inner is None:
            with eqn.ctx.manager:
                values = eqn.primitive.bind(
                    *[_read(env, v) for v in eqn.invars], **eqn.primitive.get_bind_params(eqn.params)
                )
            env.update(zip(eqn.outvars, values if eqn.primitive.multiple_results else [values], strict=True))
            continue
        inside: dict[Var, jax.Array] = {
            var: _read(env, outer)
            for var, outer in zip(inner.invars, eqn.invars, strict=True)
            if is_literal(outer) or outer in env
        }
        _evaluate(inner, inside, [inner.outvars[i] for i in outputs])
        env.update((eqn.outvars[i], _read(inside, inner.outvars[i])) for i in outputs)


def _inputs_read(jaxpr: Jaxpr, outputs: Sequence[int]) -> list[int]:
    """The positions of ``jaxpr``'s inputs that its ``outputs`` read (calls followed inside)."""
    needed = {v for i in outputs if is_var(v := jaxpr.outvars[i])}
    for eqn in reversed(jaxpr.eqns):
        wanted = [i for i, v in enumerate(eqn.outvars) if v in needed]
        if not wanted:
            continue
        inner = called_jaxpr(eqn)
        inputs = range(len(eqn.invars)) if inner is None else _inputs_read(inner, wanted)
        needed.update(v for i in inputs if is_var(v := eqn.invars[i]))
    return [i for i, var in enumerate(jaxpr.invars) if var in needed]
