"""An optimizer per sub-network (``Trainer(optimizer={"generator": ..., "discriminator": ...})``):
each key a regular expression matched (``re.match``) against parameter paths written
``generator/Dense_0/kernel``; every trainable leaf matches exactly one key. Built on optax's
``multi_transform``, the one partition where freezing lives too: frozen leaves get the
``"frozen"`` label (``set_to_zero``, no state), so one optimizer state tree holds every group's.
:meth:`OptimizerGroups.update` updates one group alone: its parameters and its part of the
state (a GAN's alternating steps).

>>> import jax.numpy as jnp, optax
>>> params = {"gen": {"kernel": jnp.ones(2)}, "disc": {"kernel": jnp.ones(3)}}
>>> groups = OptimizerGroups({"gen": optax.sgd(1.0), "disc": optax.adam(1e-3)})
>>> tx = groups.transform(lambda path, leaf: True)
>>> state = tx.init(params)
>>> grads = jax.tree.map(jnp.ones_like, params)
>>> new_params, state = groups.update(params, state, grads, "gen")
>>> new_params["gen"]["kernel"].tolist(), new_params["disc"]["kernel"].tolist()
([0.0, 0.0], [1.0, 1.0, 1.0])
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax

from trainkit.core.checks import SettingError
from trainkit.core.tree import KeyPath, PyTree, leaf_name

#: the label of the frozen leaves (``trainable=``, LoRA's base): no update, no state
FROZEN = "frozen"

Trains = Callable[[str, Any], bool]


class OptimizerGroups:
    """The groups of a dict of optimizers (see the module docstring). Raises for a key that is
    not a regular expression, a value that is not an optax transformation, or a group named
    ``"frozen"``."""

    def __init__(self, spec: Mapping[str, optax.GradientTransformation]):
        if not spec:
            raise ValueError("optimizer={} names no group: give {'<path regex>': optax.adam(1e-3), ...}.")
        self.optimizers: dict[str, optax.GradientTransformation] = {}
        self._patterns: dict[str, re.Pattern[str]] = {}
        for key, tx in spec.items():
            if not isinstance(key, str) or key == FROZEN:
                raise ValueError(
                    f"optimizer= has the key {key!r}: keys are regular expressions matched (re.match) against "
                    f"parameter paths such as 'generator/Dense_0/kernel', and {FROZEN!r} is trainkit's label of the "
                    "frozen parameters."
                )
            if not isinstance(tx, optax.GradientTransformation):
                raise TypeError(
                    f"optimizer[{key!r}] must be an optax.GradientTransformation such as optax.adam(1e-3); received "
                    f"{type(tx).__name__}."
                )
            try:
                self._patterns[key] = re.compile(key)
            except re.error as error:
                raise ValueError(f"optimizer= key {key!r} is not a regular expression ({error}).") from None
            self.optimizers[key] = tx

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.optimizers)

    def label(self, path: str) -> list[str]:
        """The groups whose key matches ``path`` at its start (``re.match``)."""
        return [key for key, pattern in self._patterns.items() if pattern.match(path)]

    def labels(self, params: PyTree, trains: Trains) -> PyTree:
        """A group name per leaf (``"frozen"`` for the leaves ``trains`` says do not train);
        raises naming every trainable leaf that matches no key or several."""
        none: list[str] = []
        several: list[str] = []
        used: set[str] = set()
        frozen: dict[str, str] = {}  # a key matching frozen parameters: one of them

        def one(path: KeyPath, leaf: object) -> str:
            name = leaf_name(path)
            if not trains(name, leaf):
                frozen.update({key: name for key in self.label(name)})
                return FROZEN
            found = self.label(name)
            used.update(found)
            if len(found) != 1:
                (none if not found else several).append(f"{name} ({', '.join(map(repr, found))})" if found else name)
                return FROZEN
            return found[0]

        labels = jax.tree_util.tree_map_with_path(one, params)
        idle = [key for key in self.optimizers if key not in used]
        if idle and not (none or several):
            what = [
                f"{key!r} (only frozen parameters, e.g. {frozen[key]})" if key in frozen else repr(key) for key in idle
            ]
            raise SettingError(
                f"optimizer= has keys that update no trainable parameter: {', '.join(what)}. A frozen sub-network (a "
                "distillation teacher, trainable= leaves it out) gets no gradient, no update and no optimizer state: "
                "drop its key. A key that matches nothing is misspelt: parameters are named by their paths, e.g. "
                f"{[leaf_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)][:4]}."
            )
        if none or several:
            problems = []
            if none:
                problems.append(f"{len(none)} trainable parameter(s) match no key: {none[:6]}")
            if several:
                problems.append(f"{len(several)} match several keys: {several[:6]}")
            raise SettingError(
                f"optimizer= is a dict of {list(self.optimizers)}, and each trainable parameter must match exactly "
                f"one key (re.match against its path): {'; '.join(problems)}. Add a key for the unmatched ones, make "
                "overlapping keys exclusive (anchored prefixes such as 'generator/' and 'discriminator/'), or "
                "freeze those parameters with trainable=."
            )
        return labels

    def transform(self, trains: Trains) -> optax.GradientTransformation:
        """One ``optax.multi_transform`` over the groups and the frozen leaves."""
        return optax.multi_transform(
            {**self.optimizers, FROZEN: optax.set_to_zero()}, lambda params: self.labels(params, trains)
        )

    def require(self, group: str) -> None:
        if group not in self.optimizers:
            raise SettingError(
                f"There is no optimizer group {group!r}: the groups are {list(self.optimizers)} (the keys of "
                "optimizer=). Pass one of them, or group=None to update every group."
            )

    def update(
        self,
        params: PyTree,
        opt_state: optax.MultiTransformState,
        grads: PyTree,
        group: str,
        trains: Trains | None = None,
    ) -> tuple[PyTree, optax.MultiTransformState]:
        """``group``'s parameters updated from ``grads`` and its part of the optimizer state;
        every other leaf and state untouched (bit for bit); ``trains`` as :meth:`labels` takes it."""
        self.require(group)
        labels = self.labels(params, trains or (lambda name, leaf: True))
        mask = jax.tree.map(lambda label: label == group, labels)
        masked = optax.masked(self.optimizers[group], mask)
        updates, inner = masked.update(grads, opt_state.inner_states[group], params)
        new_params = jax.tree.map(
            lambda selected, old, update: optax.apply_updates(old, update) if selected else old, mask, params, updates
        )
        return new_params, optax.MultiTransformState({**opt_state.inner_states, group: inner})

    def inner_state(self, opt_state: optax.MultiTransformState, group: str) -> PyTree:
        """``group``'s part of the optimizer state (its learning rate, its bytes)."""
        self.require(group)
        return opt_state.inner_states[group]

    def with_inner_state(
        self, opt_state: optax.MultiTransformState, group: str, inner: PyTree
    ) -> optax.MultiTransformState:
        self.require(group)
        return optax.MultiTransformState({**opt_state.inner_states, group: inner})
