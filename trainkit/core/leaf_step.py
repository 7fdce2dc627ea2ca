"""A training step compiled over the state's leaves, so a dispatch-bound loop passes a flat list.

Every compiled call flattens its arguments and builds its outputs back: for a ``TrainState``
that is the state's dataclass, its parameter and optimizer dicts (sorted on every flatten) and
the optax state's tuples, each call. A small model's step is shorter than that work: on a CPU
(MLP 32-64-10, batch 32) the state's tree cost a loop about a fifth of its steps per second. A
:class:`LeafStep` is compiled over the state's leaves instead; the loop threads the list from
call to call (:meth:`trainkit.core.session.Session.stepped_leaves`) and the ``TrainState`` is
built only when something reads it. Called with a state, it is the step it wraps.

>>> import jax, jax.numpy as jnp
>>> state = {"w": jnp.ones(2), "step": jnp.zeros((), jnp.int32)}
>>> def step(state, totals, batch):
...     return {"w": state["w"] - batch, "step": state["step"] + 1}, totals + 1
>>> compiled = LeafStep.jit(step, jax.tree.structure(state), donate_state=False)
>>> leaves, totals = compiled.call_leaves(jax.tree.leaves(state), 0, jnp.ones(2))
>>> new, _ = compiled(state, 0, jnp.ones(2))
>>> [float(a.sum()) for a in leaves], int(new["step"])  # leaves in key order: step, w
([1.0, 0.0], 1)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from trainkit.core.tree import PyTree


def over_leaves(step: Callable, treedef: Any) -> Callable:
    """``step(state, *rest) -> (state, *outputs)`` as ``(state leaves, *rest) -> (state leaves,
    *outputs)`` (named as ``step``, which names its compiled program)."""

    def leaf_step(leaves: list, *rest: Any) -> tuple:
        state, *outputs = step(jax.tree.unflatten(treedef, leaves), *rest)
        return (jax.tree.leaves(state), *outputs)

    leaf_step.__name__ = leaf_step.__qualname__ = step.__name__
    return leaf_step


class LeafStep:
    """A step ``(state, *rest) -> (state, *outputs)`` compiled as ``jitted`` over the state's
    leaves (``treedef``: the state's structure). :meth:`call_leaves` is the loop's call;
    calling it with a state, or :meth:`lower`, works as the wrapped step does."""

    def __init__(self, jitted: Any, treedef: Any):
        self.jitted, self.treedef = jitted, treedef

    @classmethod
    def jit(
        cls,
        step: Callable,
        treedef: Any,
        in_shardings: Any = None,
        out_shardings: Any = None,
        donate_state: bool = True,
    ) -> LeafStep:
        """``step`` jitted over leaves; ``in_shardings`` / ``out_shardings`` as ``jax.jit``'s,
        with the state's entry a tree of shardings (flattened here) or ``None``."""
        options: dict[str, Any] = {"donate_argnums": (0,) if donate_state else ()}
        if in_shardings is not None:
            options["in_shardings"] = (_leaves_of(in_shardings[0], treedef), *in_shardings[1:])
        if out_shardings is not None:
            options["out_shardings"] = (_leaves_of(out_shardings[0], treedef), *out_shardings[1:])
        return cls(jax.jit(over_leaves(step, treedef), **options), treedef)

    def call_leaves(self, leaves: list, *rest: Any) -> tuple:
        """One call on the state's leaves: ``(new leaves, *outputs)``."""
        return self.jitted(leaves, *rest)

    def __call__(self, state: PyTree, *rest: Any) -> tuple:
        leaves, *outputs = self.jitted(jax.tree.leaves(state), *rest)
        return (jax.tree.unflatten(self.treedef, leaves), *outputs)

    def lower(self, state: PyTree, *rest: Any) -> Any:
        """The compiled program lowered for a state (abstract or real) and the other arguments."""
        return self.jitted.lower(jax.tree.leaves(state), *rest)


def _leaves_of(shardings: PyTree, treedef: Any) -> list:
    """A tree of shardings shaped as the state, as the list its leaves take (a single sharding
    stands for every leaf)."""
    if isinstance(shardings, jax.sharding.Sharding):
        return [shardings] * treedef.num_leaves
    return treedef.flatten_up_to(shardings)
