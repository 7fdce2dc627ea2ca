"""Which parameters train (``Trainer(trainable=...)``): a regex over parameter paths
(``re.search``), a list of them, or a callable ``(path, leaf) -> bool``. Frozen leaves get no
gradient, no optimizer state (optax's ``multi_transform`` with ``set_to_zero``: Adam's moments
are not allocated for them) and are carried through the step unchanged, bit for bit.

>>> import optax
>>> params = {"body": {"kernel": np.ones((3, 4))}, "head": {"kernel": np.ones((4, 2)), "bias": np.zeros(2)}}
>>> mask = Trainable.of(r"^head/").mask(params)
>>> mask["body"]["kernel"], mask["head"]["kernel"]
(False, True)
>>> state = Trainable.of(r"^head/").optimizer(optax.adam(1e-3)).init(params)
>>> sum(np.size(leaf) for leaf in jax.tree.leaves(state))  # the count and the head's two moments
21
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from trainkit.core.checks import SettingError
from trainkit.core.tree import Leaf, PyTree, leaf_name, tree_bytes

TrainableSpec = str | Sequence[str] | Callable[[str, Any], bool] | None

TRAIN, FREEZE = "trainable", "frozen"


def _compiled(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as error:
        raise ValueError(
            f"trainable={pattern!r} is not a regular expression ({error}); it is searched (re.search) in parameter "
            "paths such as 'Dense_0/kernel'."
        ) from None


class Trainable:
    """A checked trainable spec (see the module docstring); ``Trainable.of(None)`` trains all.
    ``extra``: a further predicate on paths that also trains a leaf (LoRA's adapters)."""

    def __init__(self, spec: TrainableSpec, extra: Callable[[str], bool] | None = None, extra_name: str = ""):
        self.spec, self.extra, self.extra_name = (
            spec,
            extra,
            extra_name or "the extra trainable paths match no parameter",
        )
        if isinstance(spec, str):
            patterns = [_compiled(spec)]
        elif spec is None or callable(spec):
            patterns = []
        elif isinstance(spec, Sequence) and all(isinstance(p, str) for p in spec):
            patterns = [_compiled(p) for p in spec]
        else:
            raise TypeError(
                f"trainable= takes a regex over parameter paths, a list of them, or a callable (path, leaf) -> bool; "
                f"received {spec!r}."
            )
        self._patterns = patterns
        #: each parameter's decision by its path, made once (on the first leaf asked about: the
        #: parameter itself), however often the step, the optimizer's labels (also on gradients, where a
        #: frozen leaf is a scalar placeholder) and the plan ask: a slow regex or callable runs once
        self._decisions: dict[str, bool] = {}

    @classmethod
    def of(
        cls, spec: TrainableSpec | Trainable, extra: Callable[[str], bool] | None = None, extra_name: str = ""
    ) -> Trainable:
        return spec if isinstance(spec, Trainable) else cls(spec, extra, extra_name)

    @property
    def freezes(self) -> bool:
        """Whether any parameter may be frozen (``False``: everything trains, as without a spec)."""
        return self.spec is not None or self.extra is not None

    def trains(self, name: str, leaf: Any) -> bool:
        """Whether the parameter at path ``name`` trains (decided once per leaf)."""
        if name not in self._decisions:
            self._decisions[name] = self._decide(name, leaf)
        return self._decisions[name]

    def _decide(self, name: str, leaf: Any) -> bool:
        if self.extra is not None and self.extra(name):
            return True
        if self.spec is None:
            return self.extra is None
        if callable(self.spec):
            try:
                return bool(self.spec(name, leaf))
            except Exception as error:  # noqa: BLE001 - the user's callable's own error, named as its
                raise SettingError(
                    f"The trainable= callable raised {type(error).__name__} for the parameter {name!r} (shape "
                    f"{tuple(np.shape(leaf))}): {error}. It is called as trainable(path, leaf) -> bool for every "
                    "parameter, the leaf possibly abstract (a jax.ShapeDtypeStruct: read its shape and dtype only)."
                ) from error
        return any(p.search(name) for p in self._patterns)

    def mask(self, params: PyTree) -> PyTree:
        """A bool per parameter leaf (static: decided from the paths, at trace time)."""
        return jax.tree_util.tree_map_with_path(lambda path, leaf: self.trains(leaf_name(path), leaf), params)

    def check(self, params: PyTree) -> None:
        """Refuses a spec that trains nothing (a typo'd regex would freeze the whole model) and
        a trained parameter that is not a float (no gradient exists for it)."""
        named = [(leaf_name(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(params)]
        integers = [
            f"{name} ({np.dtype(leaf.dtype)})"
            for name, leaf in named
            if self.trains(name, leaf) and not jnp.issubdtype(leaf.dtype, jnp.inexact)
        ]
        if integers:
            raise SettingError(
                f"The model has parameters that are not floats and cannot be trained (no gradient exists for "
                f"them): {integers[:4]}. Freeze them with trainable= (a regex of the parameters that train, e.g. "
                "trainable=r'kernel|bias'), or keep such values in another collection than 'params'."
            )
        if not self.freezes or any(jax.tree.leaves(self.mask(params))):
            return
        names = [name for name, _ in named]
        if self.spec is None:  # only the extra paths train (LoRA's adapters), and none exists
            raise SettingError(
                f"{self.extra_name}, so nothing would train. The model's parameters are named by their paths, "
                f"e.g. {names[:4]}."
            )
        raise SettingError(
            f"trainable={self.spec!r} matches none of the model's parameters, so nothing would train. Parameters "
            f"are named by their paths, e.g. {names[:4]}; trainable= is searched in them (re.search)."
        )

    def optimizer(self, tx: optax.GradientTransformation) -> optax.GradientTransformation:
        """``tx`` for the trainable leaves, ``set_to_zero`` (no state) for the frozen ones."""
        if not self.freezes:
            return tx

        def labels(params: PyTree) -> PyTree:
            return jax.tree.map(lambda train: TRAIN if train else FREEZE, self.mask(params))

        return optax.multi_transform({TRAIN: tx, FREEZE: optax.set_to_zero()}, labels)

    def partition(self, params: PyTree) -> tuple[list[Leaf], list[Leaf]]:
        """``(trainable leaves, frozen leaves)`` of ``params``."""
        leaves, flags = jax.tree.leaves(params), jax.tree.leaves(self.mask(params))
        return [a for a, t in zip(leaves, flags) if t], [a for a, t in zip(leaves, flags) if not t]

    def state_bytes(self, state: Any) -> dict[str, int]:
        """Bytes of a (possibly abstract) state by part, before sharding: trainable and frozen
        parameters, optimizer state, model state."""
        trained, frozen = self.partition(state.params)
        parts = {"trainable params": trained, "frozen params": frozen}
        parts.update({"optimizer state": state.opt_state, "model state": state.model_state})
        return {name: tree_bytes(tree) for name, tree in parts.items()}

    def frozen_paths(self, params: PyTree) -> list[str]:
        """The paths (``"Dense_0/kernel"``, as :func:`~trainkit.core.tree.leaf_name` writes them) of
        the frozen leaves of ``params``."""
        flags = jax.tree.leaves(self.mask(params))
        named = jax.tree_util.tree_leaves_with_path(params)
        return [leaf_name(path) for (path, _), train in zip(named, flags, strict=True) if not train]

    def split(self, params: PyTree) -> tuple[list[Leaf], Callable[[list[Leaf]], PyTree]]:
        """``(trainable leaves, rebuild)``: ``rebuild(leaves)`` is ``params`` with its trainable
        leaves replaced by ``leaves`` (what a step differentiates)."""
        leaves, treedef = jax.tree.flatten(params)
        flags = jax.tree.leaves(self.mask(params))
        where = [i for i, train in enumerate(flags) if train]

        def rebuild(trained: list[Leaf]) -> PyTree:
            full = list(leaves)
            for i, leaf in zip(where, trained):
                full[i] = leaf
            return jax.tree.unflatten(treedef, full)

        return [leaves[i] for i in where], rebuild

    def full_grads(self, params: PyTree, trained: list[Leaf]) -> PyTree:
        """Gradients of the trainable leaves as a tree shaped as ``params``: each frozen leaf a
        scalar zero of its dtype (what the optimizer's ``set_to_zero`` partition discards)."""
        leaves, treedef = jax.tree.flatten(params)
        flags = jax.tree.leaves(self.mask(params))
        grads, given = [], iter(trained)
        for leaf, train in zip(leaves, flags):
            grads.append(next(given) if train else jnp.zeros((), _float_dtype(leaf)))
        return jax.tree.unflatten(treedef, grads)

    def apply_updates(self, params: PyTree, updates: PyTree) -> PyTree:
        """``optax.apply_updates`` on the trainable leaves; the frozen ones are ``params``' own,
        untouched (bit for bit, whatever their dtype)."""
        if not self.freezes:
            return optax.apply_updates(params, updates)
        return jax.tree.map(
            lambda train, old, update: optax.apply_updates(old, update) if train else old,
            self.mask(params),
            params,
            updates,
        )


def _float_dtype(leaf: Any) -> np.dtype:
    dtype = jnp.result_type(leaf)
    return dtype if jnp.issubdtype(dtype, jnp.inexact) else jnp.float32
