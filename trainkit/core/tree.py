"""Tree helpers, one of each: the ``PyTree`` alias, the spelling of a leaf's path, a tree's
signature (shape and dtype per leaf) and the difference of two signatures.

>>> import numpy as np
>>> params = {"Dense_0": {"kernel": np.zeros((3, 2), np.float32)}}
>>> [leaf_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
['Dense_0/kernel']
>>> difference("params", signature(params), signature({"Dense_0": {"kernel": np.zeros((4, 2), np.float32)}}))
["params['Dense_0']['kernel']: expected shape (3, 2) float32, received shape (4, 2) float32"]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.typing import DTypeLike

PyTree = Any
#: One leaf of a state or batch: a device array (or a traced one), a host array or scalar, or an
#: abstract ``jax.ShapeDtypeStruct`` (lowering, plans).
ArrayValue = jax.Array | np.ndarray | np.generic
Leaf = ArrayValue | jax.ShapeDtypeStruct
#: A function of pytrees, such as a step a strategy compiled: ``(state, totals, batch) -> ...``.
TreeFunction = Callable[..., PyTree]
#: A model's forward pass, as :meth:`~trainkit.core.model.ModelAdapter.apply` runs it (and remat and precision wrap it):
#: ``(params, model_state, x, *, rng, train, method=None) -> (outputs, new model state)``.
Apply = Callable[..., tuple[PyTree, PyTree]]
#: A value ``json.dumps`` writes: a data reader's saved position, a manifest's entry.
JSON = None | bool | int | float | str | list["JSON"] | dict[str, "JSON"]
#: An array's shape.
Shape = tuple[int, ...]
#: A leaf's key path, as ``jax.tree_util``'s ``*_with_path`` functions give it (entries of whatever key
#: type a pytree node registers: ``DictKey``, ``GetAttrKey``, ``SequenceKey``, a user's own).
KeyPath = tuple[Any, ...]
#: ``{path: [shape, dtype name]}``, as :func:`signature` gives it and checkpoint manifests record it.
Signature = dict[str, list[list[int] | str]]
#: An index into an array, as ``array[index]`` takes it: slices (or integers), one per axis.
Index = tuple[slice | int, ...]


def leaf_name(path: Sequence[object]) -> str:
    """``params/Dense_0/kernel`` for a key path of dict keys, attributes and indices."""
    return "/".join(str(_key(entry)) for entry in path)


def _key(entry: object) -> object:
    if isinstance(entry, jax.tree_util.DictKey):
        return entry.key
    if isinstance(entry, jax.tree_util.GetAttrKey):
        return entry.name
    if isinstance(entry, (jax.tree_util.SequenceKey, jax.tree_util.FlattenedIndexKey)):
        return entry.idx
    return entry


def signature(tree: PyTree) -> Signature:
    """``{path: [shape, dtype]}`` for every array leaf (``jax.tree_util.keystr`` paths, as
    checkpoint manifests record them)."""
    return {
        jax.tree_util.keystr(path): [list(np.shape(leaf)), str(np.dtype(leaf.dtype))]
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        if isinstance(leaf, (np.ndarray, np.generic, jax.Array, jax.ShapeDtypeStruct))
    }


def difference(
    what: str,
    expected: Signature,
    received: Signature,
    *,
    names: tuple[str, str] = ("expected", "received"),
    dtypes: bool = True,
) -> list[str]:
    """Human-readable differences between two :func:`signature` results: leaves only one side
    has, and leaves whose shapes (and, with ``dtypes``, dtypes) differ."""
    first, second = names
    problems = [f"{what}{k}: in the {first}, not in the {second}" for k in expected if k not in received]
    problems += [f"{what}{k}: in the {second}, not in the {first}" for k in received if k not in expected]
    for k in expected:
        if k not in received:
            continue
        (shape, dtype), (other_shape, other_dtype) = expected[k], received[k]
        if shape != other_shape or (dtypes and dtype != other_dtype):
            kinds = (f" {dtype}", f" {other_dtype}") if dtypes else ("", "")
            problems.append(
                f"{what}{k}: {first} shape {tuple(shape)}{kinds[0]}, {second} shape {tuple(other_shape)}{kinds[1]}"
            )
    return problems


def array_bytes(shape: Sequence[int], dtype: DTypeLike) -> int:
    """The bytes an array of ``shape`` and ``dtype`` takes as a device stores it: a 4-bit type
    (``int4``, the container of qwix's ``nf4``) half a byte an element, where NumPy's
    ``itemsize`` says one.

    >>> array_bytes((3, 4), "float32"), array_bytes((8,), jax.numpy.int4), array_bytes((3,), "bool")
    (48, 4, 3)
    """
    kind = np.dtype(dtype)
    if jax.numpy.issubdtype(kind, jax.numpy.integer):
        bits = jax.numpy.iinfo(kind).bits
    elif jax.numpy.issubdtype(kind, jax.numpy.floating):
        bits = jax.numpy.finfo(kind).bits
    else:
        bits = 8 * kind.itemsize
    return -(-int(np.prod(shape, dtype=np.int64)) * bits // 8)


def tree_bytes(tree: PyTree) -> int:
    """:func:`array_bytes` of every leaf of ``tree`` (arrays or ``jax.ShapeDtypeStruct``)."""
    return sum(array_bytes(np.shape(leaf), leaf.dtype) for leaf in jax.tree.leaves(tree))
