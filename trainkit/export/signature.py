"""What every export format needs: the inputs with a symbolic batch axis, and names for the
leaves of the inputs and outputs (a single array, a tuple, a list or a dict of them).

>>> spec = {"image": ((8, 8, 1), "float32"), "extra": ((3,), "float32")}
>>> inputs = symbolic_inputs(spec)
>>> [str(leaf.shape[0]) for leaf in jax.tree.leaves(inputs)], leaf_names(spec, "input")
(['batch', 'batch'], ['extra', 'image'])
"""

from __future__ import annotations

import jax

from trainkit.core.tree import PyTree, TreeFunction
from trainkit.data import abstract_inputs, is_spec

#: The name of the symbolic batch dimension in every format.
BATCH = "batch"


def symbolic_inputs(spec: PyTree) -> PyTree:
    """``jax.ShapeDtypeStruct`` inputs of the per-example ``spec`` (:func:`trainkit.data.example_spec`)
    with one symbolic batch dimension shared by all of them."""
    (batch,) = jax.export.symbolic_shape(BATCH)
    return abstract_inputs(spec, batch)  # type: ignore[arg-type]  # a symbolic dimension is a size


def output_names(function: TreeFunction, variables: PyTree, inputs: PyTree) -> list[str]:
    """:func:`leaf_names` of the outputs of ``function(variables, x)`` for the symbolic ``inputs``
    (traced, never run)."""
    return leaf_names(jax.eval_shape(lambda x: function(variables, x), inputs), "output")


def leaf_names(tree: PyTree, prefix: str) -> list[str]:
    """One name per leaf, in ``jax.tree.leaves`` order: ``prefix`` for a single array,
    ``prefix_0``, ``prefix_1`` for a sequence, the keys for a dict (joined by ``_`` when nested)."""
    paths = [path for path, _ in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_spec)]
    if paths == [()]:
        return [prefix]
    names = []
    for path in paths:
        parts = [str(entry.key) if isinstance(entry, jax.tree_util.DictKey) else str(entry.idx) for entry in path]
        named = isinstance(path[0], jax.tree_util.DictKey)
        names.append("_".join(parts) if named else "_".join([prefix, *parts]))
    return names
