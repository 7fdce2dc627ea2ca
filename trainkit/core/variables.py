"""A model's variables by name, as published weights name them: parameters by their path
(``Dense_0/kernel``), other collections with the collection first (``batch_stats/bn/mean``).

>>> import numpy as np
>>> params, model_state = {"fc": {"kernel": np.zeros((3, 2))}}, {"batch_stats": {"bn": {"mean": np.zeros(2)}}}
>>> sorted(named_variables(params, model_state))
['batch_stats/bn/mean', 'fc/kernel']
>>> new_params, _ = replaced(params, model_state, {"fc/kernel": np.ones((3, 2))})
>>> float(new_params["fc"]["kernel"].sum())
6.0
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax

from trainkit.core.tree import ArrayValue, KeyPath, PyTree, leaf_name


def named_variables(
    params: PyTree, model_state: PyTree, is_leaf: Callable[[PyTree], bool] | None = None
) -> dict[str, PyTree]:
    """Every variable leaf by name (parameters first; ``is_leaf`` marks parameter nodes kept whole)."""
    named = {leaf_name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_leaf)}
    named.update({leaf_name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(model_state)})
    return named


def replaced(params: PyTree, model_state: PyTree, arrays: Mapping[str, ArrayValue]) -> tuple[PyTree, PyTree]:
    """``params`` and ``model_state`` with the leaves named in ``arrays`` replaced."""

    def swap(path: KeyPath, leaf: PyTree) -> PyTree:
        return arrays.get(leaf_name(path), leaf)

    return jax.tree_util.tree_map_with_path(swap, params), jax.tree_util.tree_map_with_path(swap, model_state)
