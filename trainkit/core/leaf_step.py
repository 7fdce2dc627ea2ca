"""A training step compiled over the state's leaves, its small ones packed into one array, so a
dispatch-bound loop passes a short flat list.

Every compiled call flattens its arguments and builds its outputs back: for a ``TrainState``
that is the state's dataclass, its parameter and optimizer dicts (sorted on every flatten) and
the optax state's tuples, each call. A small model's step is shorter than that work: on a CPU
(MLP 32-64-10, batch 32) the state's tree cost a loop about a fifth of its steps per second. A
:class:`LeafStep` is compiled over the state's *carried* leaves instead; the loop threads that
list from call to call (:meth:`trainkit.record.session.Session.carried`) and the ``TrainState``
is built only when something reads it. Called with a state, it is the step it wraps.

Each buffer a call takes and returns costs XLA:CPU about 1.5 us, so the state's smallest
replicated leaves (the step counter, the rng key, Adam's count, the loss scale: at most
:data:`SMALL_LEAF` elements of 32 bits) travel as one ``uint32`` array (:class:`Carry`): on
that MLP, 3 buffers become 1 and the call took 5 us less (13 us less CPU time). The state, and
every checkpoint, keeps its leaves as they are.

>>> import jax, jax.numpy as jnp
>>> state = {"w": jnp.ones(40), "step": jnp.zeros((), jnp.int32), "seen": jnp.zeros((), jnp.float32)}
>>> def step(state, totals, batch):
...     return {"w": state["w"] - batch, "step": state["step"] + 1, "seen": state["seen"] + 2}, totals + 1
>>> compiled = LeafStep.jit(step, state, donate_state=False)
>>> carried, totals = compiled.call_carried(compiled.carried(jax.tree.leaves(state)), 0, jnp.ones(40))
>>> len(carried), [float(a.sum()) for a in compiled.leaves(carried)]  # w, then seen and step packed
(2, [2.0, 1.0, 0.0])
>>> new, _ = compiled(state, 0, jnp.ones(40))
>>> int(new["step"]), float(new["seen"])
(1, 2.0)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import PyTreeDef

from trainkit.core.offload import in_host_memory
from trainkit.core.tree import ArrayValue, Leaf, PyTree, Shape, TreeFunction

#: A replicated leaf of at most this many 32-bit elements travels packed (:class:`Carry`): counters
#: and keys. Not parameters: packing that MLP's 10- and 16-element biases (and their Adam moments)
#: made some steps faster and others 1.5x slower (XLA:CPU fuses the update differently).
SMALL_LEAF = 2
_PACKABLE = (np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.float32))


class Carry:
    """Which of a state's leaves cross a call packed into one ``uint32`` array, and how.

    ``abstract_leaves``: the state's leaves (arrays or ``jax.ShapeDtypeStruct``);
    ``replicated``: whether each is whole on every device (a sharded leaf is never packed).
    Fewer than two small leaves: nothing is packed (the carried list is the leaves).

    >>> carry = Carry([np.zeros(3), np.int32(4), np.zeros(2, np.uint32)], [True, True, True])
    >>> carry.big, carry.small
    ((0,), (1, 2))
    >>> [a.tolist() for a in carry.unpacked(carry.packed([np.zeros(3), np.int32(4), np.ones(2, np.uint32)]))]
    [[0.0, 0.0, 0.0], 4, [1, 1]]
    """

    def __init__(self, abstract_leaves: Sequence[Leaf], replicated: Sequence[bool]):
        small = [i for i, (a, whole) in enumerate(zip(abstract_leaves, replicated, strict=True)) if whole and _small(a)]
        self.small: tuple[int, ...] = tuple(small) if len(small) > 1 else ()
        self.big: tuple[int, ...] = tuple(i for i in range(len(abstract_leaves)) if i not in self.small)
        packed = [abstract_leaves[i] for i in self.small]
        self.specs = tuple((tuple(np.shape(leaf)), np.dtype(leaf.dtype)) for leaf in packed)
        self.sizes = tuple(int(np.prod(shape, dtype=np.int64)) for shape, _ in self.specs)
        self.count = len(abstract_leaves)

    def key(self) -> tuple[tuple[int, ...], tuple[tuple[Shape, np.dtype], ...], int]:
        """Equal for two carries that lay out the same leaves the same way."""
        return self.small, self.specs, self.count

    def packed(self, leaves: Sequence[ArrayValue]) -> list[ArrayValue]:
        """The carried list of ``leaves`` (traced, or host values): the big leaves as they are,
        then the small ones' bits in one array."""
        if not self.small:
            return list(leaves)
        xp = np if all(isinstance(leaves[i], (np.ndarray, np.generic)) for i in self.small) else jnp
        bits = [_bits(leaves[i], xp) for i in self.small]
        return [leaves[i] for i in self.big] + [xp.concatenate(bits)]

    def unpacked(self, carried: Sequence[ArrayValue]) -> list[ArrayValue]:
        """The state's leaves from a carried list (traced, or host values)."""
        if not self.small:
            return list(carried)
        leaves: list[ArrayValue] = [np.empty(0)] * self.count  # every entry set below
        for i, value in zip(self.big, carried, strict=False):
            leaves[i] = value
        packed, offset = _array(carried[-1]), 0
        for i, (shape, dtype), size in zip(self.small, self.specs, self.sizes, strict=True):
            leaves[i] = _from_bits(packed[offset : offset + size], dtype).reshape(shape)
            offset += size
        return leaves

    def abstract(self, leaves: Sequence[Leaf], sharding: jax.sharding.Sharding | None = None) -> list[Leaf]:
        """The carried list for lowering (``leaves`` abstract or real), the packed array a
        ``jax.ShapeDtypeStruct`` with the ``sharding`` it is placed in (the program traced is
        then the one a placed array gets, the same compile-cache entry)."""
        if not self.small:
            return list(leaves)
        packed = jax.ShapeDtypeStruct((sum(self.sizes),), jnp.uint32, sharding=sharding)
        return [leaves[i] for i in self.big] + [packed]


def _small(leaf: Leaf) -> bool:
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):  # a typed PRNG key
        return False
    weak = isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) and leaf.weak_type  # rebuilt strong: a new trace
    return not weak and np.dtype(leaf.dtype) in _PACKABLE and int(np.prod(np.shape(leaf))) <= SMALL_LEAF


def _bits(leaf: ArrayValue, xp: ModuleType) -> jax.Array | np.ndarray:
    if xp is np:
        return np.ascontiguousarray(leaf).reshape(-1).view(np.uint32)
    return jax.lax.bitcast_convert_type(jnp.reshape(jnp.asarray(leaf), (-1,)), jnp.uint32)


def _from_bits(bits: jax.Array | np.ndarray, dtype: np.dtype) -> jax.Array | np.ndarray:
    return bits.view(dtype) if isinstance(bits, np.ndarray) else jax.lax.bitcast_convert_type(bits, dtype)


def _array(value: ArrayValue) -> jax.Array | np.ndarray:
    """The packed array of a carried list (an array, never a scalar)."""
    if not isinstance(value, (jax.Array, np.ndarray)):
        raise TypeError(f"the packed leaves are an array; received {type(value).__name__}")
    return value


def _host(leaf: ArrayValue) -> np.ndarray:
    """A replicated leaf's value on this host, read from one local copy (no collective)."""
    return np.asarray(leaf.addressable_data(0)) if isinstance(leaf, jax.Array) else np.asarray(leaf)


def over_carried(step: TreeFunction, treedef: PyTreeDef, carry: Carry) -> TreeFunction:
    """``step(state, *rest) -> (state, *outputs)`` as ``(carried, *rest) -> (carried,
    *outputs)`` (named as ``step``, which names its compiled program)."""

    def leaf_step(carried: list[ArrayValue], *rest: PyTree) -> tuple[PyTree, ...]:
        state, *outputs = step(jax.tree.unflatten(treedef, carry.unpacked(carried)), *rest)
        return (carry.packed(jax.tree.leaves(state)), *outputs)

    leaf_step.__name__ = leaf_step.__qualname__ = step.__name__
    return leaf_step


class LeafStep:
    """A step ``(state, *rest) -> (state, *outputs)`` compiled as ``jitted`` over the state's
    carried leaves (``treedef``: the state's structure; ``carry``: its :class:`Carry`;
    ``place``: puts host values on every device, as the strategy places replicated values;
    ``sharding``: the packed array's, where the compiled step pins it).
    :meth:`call_carried` is the loop's call; calling it with a state, or :meth:`lower`, works
    as the wrapped step does."""

    def __init__(
        self,
        jitted: jax.stages.Wrapped,
        treedef: PyTreeDef,
        carry: Carry,
        place: Callable[[PyTree], PyTree] = jax.device_put,
        sharding: jax.sharding.Sharding | None = None,
    ):
        self.jitted, self.treedef, self.carry, self.place, self.sharding = jitted, treedef, carry, place, sharding

    @classmethod
    def jit(
        cls,
        step: TreeFunction,
        abstract_state: PyTree,
        in_shardings: tuple[PyTree, ...] | None = None,
        out_shardings: tuple[PyTree, ...] | None = None,
        donate_state: bool = True,
        replicated: jax.sharding.Sharding | None = None,
    ) -> LeafStep:
        """``step`` jitted over carried leaves; ``in_shardings`` / ``out_shardings`` as
        ``jax.jit``'s, with the state's entry a tree of shardings (or one for every leaf) or
        ``None``; ``replicated``: the packed array's sharding (with shardings given)."""
        leaves, treedef = jax.tree.flatten(abstract_state)
        state_shardings = None if in_shardings is None else _leaves_of(in_shardings[0], treedef)
        whole = [True] * len(leaves) if state_shardings is None else [_packable(s) for s in state_shardings]
        carry = Carry(leaves, whole)
        options: dict[str, Any] = {"donate_argnums": (0,) if donate_state else ()}
        if in_shardings is not None and state_shardings is not None:
            options["in_shardings"] = (_carried(carry, state_shardings, replicated), *in_shardings[1:])
        if out_shardings is not None:
            outs = _carried(carry, _leaves_of(out_shardings[0], treedef), replicated)
            options["out_shardings"] = (outs, *out_shardings[1:])
        place = jax.device_put if replicated is None else (lambda tree: jax.device_put(tree, replicated))
        return cls(jax.jit(over_carried(step, treedef, carry), **options), treedef, carry, place, replicated)

    def call_carried(self, carried: list[ArrayValue], *rest: PyTree) -> tuple[PyTree, ...]:
        """One call on the state's carried leaves: ``(new carried leaves, *outputs)``."""
        outputs: tuple[PyTree, ...] = self.jitted(carried, *rest)
        return outputs

    def carried(self, leaves: Sequence[ArrayValue]) -> list[ArrayValue]:
        """The state's leaves as this step takes them (the small ones packed on the host and
        placed as they were)."""
        if not self.carry.small:
            return list(leaves)
        host = [_host(leaf) if i in self.carry.small else leaf for i, leaf in enumerate(leaves)]  # big: not read
        packed = self.carry.packed(host)[-1]
        return [leaves[i] for i in self.carry.big] + [
            self._placed_like(np.asarray(packed), leaves[self.carry.small[0]])
        ]

    def leaves(self, carried: Sequence[ArrayValue]) -> list[ArrayValue]:
        """The state's leaves from carried ones (the small ones unpacked on the host and placed
        as the packed array is)."""
        if not self.carry.small:
            return list(carried)
        packed = carried[-1]
        leaves = self.carry.unpacked([*carried[:-1], _host(packed)])
        for i in self.carry.small:
            leaves[i] = self._placed_like(np.asarray(leaves[i]), packed)
        return leaves

    def _placed_like(self, value: np.ndarray, like: ArrayValue) -> ArrayValue:
        """``value`` in the sharding of the live array ``like``, from this process's copy alone
        (a state read on one process is no collective); ``place`` for a host ``like``."""
        if not isinstance(like, jax.Array):
            placed: ArrayValue = self.place(value)
            return placed
        return jax.make_array_from_callback(value.shape, like.sharding, lambda index: value[index])

    def state(self, carried: Sequence[ArrayValue]) -> PyTree:
        """The ``TrainState`` (or other tree) of carried leaves."""
        return jax.tree.unflatten(self.treedef, self.leaves(carried))

    def __call__(self, state: PyTree, *rest: PyTree) -> tuple[PyTree, ...]:
        carried, *outputs = self.jitted(self.carried(jax.tree.leaves(state)), *rest)
        return (self.state(carried), *outputs)

    def lower(self, state: PyTree, *rest: PyTree) -> jax.stages.Lowered:
        """The compiled program lowered for a state (abstract or real: a real state's carried
        leaves are real too, which ``pmap`` on several processes needs) and the other arguments."""
        leaves = jax.tree.leaves(state)
        if all(isinstance(leaves[i], jax.Array) for i in self.carry.small):
            return self.jitted.lower(self.carried(leaves), *rest)
        return self.jitted.lower(self.carry.abstract(leaves, self.sharding), *rest)


def _packable(sharding: jax.sharding.Sharding) -> bool:
    """A leaf whole on every device and in device memory (a leaf in host memory stays apart)."""
    return sharding.is_fully_replicated and not in_host_memory(sharding)


def _leaves_of(shardings: PyTree, treedef: PyTreeDef) -> list[jax.sharding.Sharding]:
    """A tree of shardings shaped as the state, as the list its leaves take (a single sharding
    stands for every leaf)."""
    if isinstance(shardings, jax.sharding.Sharding):
        return [shardings] * treedef.num_leaves
    leaves: list[jax.sharding.Sharding] = treedef.flatten_up_to(shardings)
    return leaves


def _carried(
    carry: Carry, shardings: list[jax.sharding.Sharding], replicated: jax.sharding.Sharding | None
) -> list[jax.sharding.Sharding]:
    """The carried list's shardings: the big leaves' own, then ``replicated`` for the packed array."""
    if not carry.small:
        return shardings
    if replicated is None:
        raise ValueError("LeafStep.jit with shardings packs small leaves: pass replicated= (the packed array's).")
    return [shardings[i] for i in carry.big] + [replicated]
