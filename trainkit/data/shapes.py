"""Batches given as shapes: ``jax.ShapeDtypeStruct`` leaves, so that a pod-sized batch is
planned (``trainer.plan(..., target=...)``, ``find_batch_size``) on a laptop without building
it. Each shape stands in as a zero array that takes no memory (one zero broadcast to the
shape: ``np.broadcast_to``, read-only), so that the data layer's checks and the shapes it
derives run as they do for arrays, while the compile sees only shapes.

>>> import jax, numpy as np
>>> batch = (jax.ShapeDtypeStruct((2**20, 4096), np.float32), jax.ShapeDtypeStruct((2**20,), np.int32))
>>> x, y = stand_in(batch)
>>> is_shapes(batch), x.shape, x.dtype.name, x.strides, y.shape
(True, (1048576, 4096), 'float32', (0, 0), (1048576,))
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from trainkit.core.tree import PyTree


def is_shapes(data: object) -> bool:
    """Whether ``data`` (a batch, an ``(x, y[, w])`` tuple) has ``jax.ShapeDtypeStruct`` leaves;
    refused when it mixes them with arrays (one batch is given one way)."""
    leaves = jax.tree.leaves(data)
    shapes = [isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves]
    if any(shapes) and not all(shapes):
        kinds = sorted({type(leaf).__name__ for leaf in leaves})
        raise TypeError(
            f"The sample batch mixes jax.ShapeDtypeStruct leaves with arrays ({', '.join(kinds)}): give every "
            "input and target as a jax.ShapeDtypeStruct (a batch planned from shapes), or all as arrays."
        )
    return bool(shapes) and all(shapes)


def stand_in(data: PyTree) -> PyTree:
    """``data`` with each ``jax.ShapeDtypeStruct`` a read-only zero array of its shape and dtype
    that takes no memory (every element the same zero)."""

    def zeros(leaf: Any) -> Any:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        if not leaf.shape:
            raise ValueError(
                f"A sample batch's jax.ShapeDtypeStruct has shape {leaf.shape}: a batch leaf needs a leading "
                "axis of rows, such as jax.ShapeDtypeStruct((batch_size, ...), dtype)."
            )
        return np.broadcast_to(np.zeros((), leaf.dtype), leaf.shape)

    return jax.tree.map(zeros, data)
