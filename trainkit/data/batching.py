"""Batching: the rules of Keras's ``x`` / ``y`` / ``sample_weight``, rows, padding and masks.

Every batch has the same static shape. The last partial batch is padded with rows whose
``mask`` is 0, so no sample is dropped, none counts twice and nothing recompiles. The padded
rows repeat the batch's real rows, never zeros: the model runs on them too, and an input it
never sees in the data (an all-zero row, which ``x / ||x||`` turns into NaN) would put NaN in
the gradient, which the mask does not remove (``0 * NaN``).

>>> import numpy as np
>>> batch = pad_batch(np.arange(6.0).reshape(3, 2), np.arange(3), None, 5)
>>> batch["x"][:, 0].tolist(), batch["y"].tolist(), batch["mask"].tolist()
([0.0, 2.0, 4.0, 0.0, 2.0], [0, 1, 2, 0, 1], [1.0, 1.0, 1.0, 0.0, 0.0])
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.typing import DTypeLike

from trainkit.core.step import full_mask
from trainkit.core.tree import PyTree

Batch = dict[str, Any]


def _is_array(obj: object) -> bool:
    return isinstance(obj, (np.ndarray, jax.Array)) or (hasattr(obj, "__array__") and hasattr(obj, "shape"))


def is_array_tree(obj: object) -> bool:
    """An array, a non-empty dict of array trees, or a non-empty list / tuple of arrays or dicts
    (Keras's multi-input ``x``; a list of tuples is an iterable of ``(x, y)`` batches)."""
    if _is_array(obj):
        return True
    if isinstance(obj, dict) and obj:
        return all(is_array_tree(v) for v in obj.values())
    if isinstance(obj, (list, tuple)) and obj:
        return all(_is_array(v) or isinstance(v, dict) and is_array_tree(v) for v in obj)
    return False


def split_xyw(element: PyTree) -> tuple[PyTree, PyTree, PyTree]:
    """``(x, y, sample_weight)`` from a tuple, or bare ``x``. One rule for dicts, Keras's: a
    dict is the model's inputs, whatever its keys (targets come from a tuple or ``y``).

    >>> split_xyw(({"x": 1, "y": 2}, 3))
    ({'x': 1, 'y': 2}, 3, None)
    """
    if isinstance(element, tuple):
        if not 1 <= len(element) <= 3:
            raise ValueError(
                f"A data tuple must be (x,), (x, y) or (x, y, sample_weight); received a tuple of {len(element)} items."
            )
        x, y, w = (*element, None, None)[:3]
        return x, y, w
    return element, None, None


def host_array(a: object) -> np.ndarray | jax.Array:
    """A leaf as an array the rest of trainkit reads: NumPy and ``jax.Array`` as they are;
    anything else (a torch tensor, a ``tf.Tensor``, a list) through NumPy, so no framework
    type (``torch.dtype``, ``tf.DType``) reaches a step."""
    if isinstance(a, (np.ndarray, jax.Array)):
        return a
    if hasattr(a, "detach") and hasattr(a, "cpu"):  # torch: off the autograd graph and the GPU
        a = a.detach().cpu()
    return np.asarray(a)


def to_host(tree: PyTree) -> PyTree:
    """:func:`host_array` on every leaf (``None`` stays ``None``)."""
    return None if tree is None else jax.tree.map(host_array, tree)


def num_rows(tree: PyTree) -> int:
    return int(jax.tree.leaves(tree)[0].shape[0])


def one_batch_size(data: PyTree, shards: int) -> int:
    """A batch size that holds all rows of ``data`` (``x`` or an ``(x, y[, w])`` tuple) in one
    batch that ``shards`` devices can split (padded), for Keras's ``*_on_batch``.

    >>> one_batch_size((np.zeros((5, 2)), np.zeros(5)), 4)
    8
    """
    rows = num_rows(split_xyw(data)[0])
    return -(-rows // shards) * shards


def example_spec(x: PyTree) -> PyTree:
    """Per-example shapes and dtypes of a batch of inputs (leading axis dropped)."""
    return jax.tree.map(lambda a: (tuple(a.shape[1:]), np.dtype(a.dtype).name), x)


def _is_number_list(tree: PyTree) -> bool:
    """A Python list or tuple whose leaves are all numbers, Python's or NumPy's scalars
    (``list(y)`` of an array), a column or table of values."""
    leaves = jax.tree.leaves(tree)
    numbers = (int, float, np.number, np.bool_)
    return isinstance(tree, (list, tuple)) and bool(leaves) and all(isinstance(v, numbers) for v in leaves)


def check_no_number_lists(parts: dict[str, PyTree]) -> None:
    """Refuses a part given as a Python list of numbers (before it becomes arrays), naming it.

    >>> check_no_number_lists({"y": [0, 1, 1]})
    Traceback (most recent call last):
    ValueError: y is a Python list of 3 values, not an array: ...
    """
    for part, tree in parts.items():
        if _is_number_list(tree):
            raise ValueError(
                f"{part} is a Python {type(tree).__name__} of {len(tree)} values, not an array: a list is read as "
                f"several inputs (Keras's multi-input x=[x1, x2]), each value one of them. Pass np.asarray({part})."
            )


def check_lengths(
    parts: dict[str, PyTree], empty: str = "The dataset is empty (0 rows); pass at least one example."
) -> int:
    """The rows every part has alike; a scalar, unequal lengths or no rows refused with what to
    pass (``empty``: the message for no rows)."""
    lengths = {}
    for part, tree in parts.items():
        if tree is None:
            continue
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if np.ndim(leaf) == 0:
                raise ValueError(
                    f"{part}{jax.tree_util.keystr(path)} is a scalar; every input needs a leading "
                    "batch axis (one row per example)."
                )
            lengths[f"{part}{jax.tree_util.keystr(path)}"] = int(np.shape(leaf)[0])
    if len(set(lengths.values())) > 1:
        detail = ", ".join(f"{k}: {v} rows" for k, v in lengths.items())
        raise ValueError(
            f"Inputs have different numbers of rows ({detail}). x, y and sample_weight must "
            "have one row per example; check that they come from the same split."
        )
    n = next(iter(lengths.values()))
    if n == 0:
        raise ValueError(empty)
    return n


def _map(fn, tree: PyTree) -> PyTree:
    """``jax.tree.map`` with a shortcut for one array, the common case: per batch, the tree
    walk would cost more than the copy of a small batch."""
    return fn(tree) if isinstance(tree, np.ndarray) else jax.tree.map(fn, tree)


def take(tree: PyTree, rows: np.ndarray | slice) -> PyTree:
    return _map(lambda a: rows_of(a, rows), tree)


def rows_of(array: np.ndarray, rows: np.ndarray | slice) -> np.ndarray:
    """``array[rows]`` as NumPy; a NumPy array's row indices through ``ndarray.take``, the same
    copy about 2 us quicker per batch of 32 rows than fancy indexing (which matters when a step
    is shorter than its dispatch).

    >>> rows_of(np.arange(5) * 10, np.array([3, 1])).tolist(), rows_of(np.arange(5), slice(1, 3)).tolist()
    ([30, 10], [1, 2])
    """
    if isinstance(array, np.ndarray) and isinstance(rows, np.ndarray):
        return array.take(rows, axis=0)
    return np.asarray(array[rows])


def abstract_batch(x: PyTree, y: PyTree, w: PyTree, batch_size: int) -> Batch:
    """:func:`pad_batch`'s result as ``jax.ShapeDtypeStruct`` leaves of ``batch_size`` rows,
    built from the shapes of ``x``, ``y`` and ``w`` (any rows) without touching their values.

    >>> batch = abstract_batch(np.zeros((3, 2)), np.zeros(3, np.int32), None, 1024)
    >>> batch["x"].shape, batch["y"].dtype.name, batch["mask"].shape
    ((1024, 2), 'int32', (1024,))
    """

    def rows(a: Any, dtype: DTypeLike | None = None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((batch_size, *np.shape(a)[1:]), a.dtype if dtype is None else dtype)

    batch: Batch = {"x": _map(rows, x)}
    if y is not None:
        batch["y"] = _map(rows, y)
    if w is not None:
        batch["sample_weight"] = rows(w, np.float32)
    batch["mask"] = jax.ShapeDtypeStruct((batch_size,), np.float32)
    return batch


def pad_batch(x, y, w, batch_size: int, *, copy: bool = False) -> Batch:
    """A batch dict padded to ``batch_size`` with its real rows repeated (zeros when it has none)
    and a float ``mask`` of real rows;
    ``copy``: arrays of its own even when nothing is padded (a pipeline's batch may live in the
    pipeline's buffers, such as grain's shared memory, which it frees or reuses after handing
    it over, while JAX on CPU may read a host array in place)."""
    n = num_rows(x)
    pad = batch_size - n

    def padded(a):
        if pad == 0:
            return np.array(a) if copy else np.asarray(a)
        a = np.asarray(a)
        repeated = a[np.arange(pad) % n] if n else np.zeros((pad,) + a.shape[1:], a.dtype)
        return np.concatenate([a, repeated])

    batch: Batch = {"x": _map(padded, x)}
    if y is not None:
        batch["y"] = _map(padded, y)
    if w is not None:
        batch["sample_weight"] = padded(np.asarray(w, np.float32))
    batch["mask"] = full_mask(batch_size) if pad == 0 else np.concatenate([full_mask(n), np.zeros(pad, np.float32)])
    return batch


def full_batch(x: np.ndarray, y: np.ndarray | None, w: np.ndarray | None) -> Batch:
    """:func:`pad_batch` of a batch that needs no padding, of single arrays (the per-step path
    of in-memory data: no tree walk).

    >>> sorted(full_batch(np.zeros((4, 2)), np.zeros(4), None))
    ['mask', 'x', 'y']
    """
    batch: Batch = {"x": x}
    if y is not None:
        batch["y"] = y
    if w is not None:
        batch["sample_weight"] = np.asarray(w, np.float32)
    batch["mask"] = full_mask(len(x))
    return batch


def check_shuffle(shuffle: object) -> None:
    if shuffle not in (True, False, "batch") or isinstance(shuffle, (int, float)) and not isinstance(shuffle, bool):
        raise ValueError(f"shuffle must be True, False or 'batch' (Keras's values); received {shuffle!r}.")


def shuffled_order(n: int, batch_size: int, shuffle: bool | str, seed: int, epoch: int) -> np.ndarray | None:
    """The epoch's row order: ``None`` (unshuffled), a permutation (``shuffle=True``), or, with
    Keras's ``shuffle="batch"``, the rows of each batch permuted among themselves (the batches
    keep their rows and their order).

    >>> shuffled_order(6, 4, "batch", 0, 0).tolist()
    [3, 2, 1, 0, 4, 5]
    """
    check_shuffle(shuffle)
    if not shuffle:
        return None
    rng = np.random.default_rng([seed, epoch])
    if shuffle == "batch":
        return np.lexsort((rng.random(n), np.arange(n) // batch_size))
    return rng.permutation(n)


def batch_rows(
    n: int,
    batch_size: int,
    shuffle: bool | str,
    seed: int,
    epoch: int,
    start: int = 0,
    process_index: int = 0,
    process_count: int = 1,
) -> Iterator[slice | np.ndarray]:
    """The rows of this process's part of every global batch from batch ``start`` on, for a
    random-access source of ``n`` rows: the same for arrays, grain's ``MapDataset``, a Hugging
    Face or a torch map-style dataset, so each reads the same rows in the same order.

    >>> [r.tolist() for r in batch_rows(10, 4, True, 0, 0, start=1, process_index=1, process_count=2)]
    [[9, 0], []]
    """
    local = batch_size // process_count
    order = shuffled_order(n, batch_size, shuffle, seed, epoch)
    mine = slice(process_index * local, (process_index + 1) * local)
    if order is not None and process_count == 1:  # the whole of each batch (a fused call names 128 a call)
        yield from (order[lo : lo + batch_size] for lo in range(start * batch_size, n, batch_size))
        return
    for lo in range(start * batch_size, n, batch_size):
        if order is None:  # a slice (a view) of the unshuffled rows
            yield slice(min(lo + mine.start, n), min(lo + mine.stop, lo + batch_size, n))
        else:
            yield order[lo : lo + batch_size][mine]


def check_batch_size(
    batch_size: int, shards: int, *, micro_batches: int = 1, pipeline: int = 1, what: str = "batch_size"
) -> None:
    """Raises if ``batch_size`` cannot be split evenly into ``shards`` device parts (each split
    again into ``micro_batches`` for gradient accumulation, and each of those into a pipeline's
    ``pipeline`` microbatches)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
        raise ValueError(f"{what}={batch_size!r}: it must be a positive integer.")
    parts = shards * micro_batches * pipeline
    if batch_size % parts:
        lower = batch_size - batch_size % parts
        upper = lower + parts
        nearest = f"{lower} or {upper}" if lower > 0 else f"{upper}"
        into = (
            f"{shards} devices"
            + (f" x {micro_batches} micro-batches (grad_accum_steps)" if micro_batches > 1 else "")
            + (f" x {pipeline} pipeline microbatches (Hybrid(microbatches=...))" if pipeline > 1 else "")
        )
        raise ValueError(
            f"{what}={batch_size} cannot be split evenly across {into} "
            f"({batch_size} / {parts} is not an integer). Use a multiple of {parts}: the "
            f"nearest valid sizes are {nearest}."
        )


def is_spec(leaf: object) -> bool:
    """A leaf of :func:`example_spec`: ``(shape, dtype name)``."""
    return isinstance(leaf, tuple) and len(leaf) == 2 and isinstance(leaf[1], str)


def abstract_inputs(spec: PyTree, rows: int) -> PyTree:
    """Inputs of ``rows`` examples with the per-example shapes of ``spec`` (:func:`example_spec`),
    as ``jax.ShapeDtypeStruct``s for tracing.

    >>> abstract_inputs(example_spec(np.zeros((8, 3), np.float32)), 2)
    ShapeDtypeStruct(shape=(2, 3), dtype=float32)
    """
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct((rows, *s[0]), s[1]), spec, is_leaf=is_spec)


def check_same_inputs(expected: PyTree, received: PyTree, *, other_lengths: bool = False) -> str:
    """Raises when ``received`` per-example input shapes differ from those the model was
    initialised with (both from :func:`example_spec`); ``other_lengths``: sizes that differ where the
    ranks agree are returned as that message instead (``predict`` / ``evaluate`` on sequences of
    another length, as Keras retraces per shape: the caller traces the model on them and raises it
    where the model cannot take them); ``""`` where nothing differs."""
    exp = dict(jax.tree_util.tree_leaves_with_path(expected, is_leaf=is_spec))
    got = dict(jax.tree_util.tree_leaves_with_path(received, is_leaf=is_spec))
    name = lambda path: "x" + jax.tree_util.keystr(path)  # noqa: E731
    missing = sorted(set(map(name, exp)) - set(map(name, got)))
    unexpected = sorted(set(map(name, got)) - set(map(name, exp)))
    if missing or unexpected:
        raise ValueError(
            f"The inputs lack {missing or 'nothing'} and have unexpected entries "
            f"{unexpected or 'none'}: the model was initialised with entries "
            f"{sorted(map(name, exp))}. Pass inputs with the same structure."
        )
    differing = []
    for path, (shape, _) in exp.items():
        other = got[path][0]
        if tuple(other) != tuple(shape):
            message = (
                f"{name(path)} has per-example shape {tuple(other)} (batch shape "
                f"(batch, {', '.join(map(str, other))})), but the model was initialised with "
                f"per-example shape {tuple(shape)}. Reshape the data to (batch, "
                f"{', '.join(map(str, shape))}), or build a new Trainer for the new shape."
            )
            if not (other_lengths and len(other) == len(shape)):
                raise ValueError(message)
            differing.append(message)
    return differing[0] if differing else ""


def describe_shapes(tree: PyTree) -> str:
    """``float32[16, 8, 8]``, or a dict / list of such, for messages about inputs.

    >>> describe_shapes({"image": np.zeros((2, 8, 8), np.float32), "id": np.zeros(2, np.int32)})
    '{id: int32[2], image: float32[2, 8, 8]}'
    """
    described = jax.tree.map(lambda a: f"{np.dtype(a.dtype).name}[{', '.join(map(str, np.shape(a)))}]", tree)
    return described if isinstance(described, str) else str(described).replace("'", "")


def check_rows_kept(inputs: PyTree, outputs: PyTree) -> None:
    """The model's outputs (traced shapes) must have one row per input row: a model that
    returns another number reads the leading axis as something else than the batch (a Conv
    given images without their channel axis convolves over the batch)."""
    rows = num_rows(inputs)
    wrong = [leaf.shape for leaf in jax.tree.leaves(outputs) if not leaf.shape or leaf.shape[0] != rows]
    if wrong:
        raise ValueError(
            f"The model returned outputs of shape {wrong[0]} for a batch of {rows} rows (inputs "
            f"{describe_shapes(inputs)}): every output needs one row per example, so the model does not treat "
            "the leading axis as the batch. A Conv given images without their channel axis ((N, H, W)) works "
            "across the batch: pass x[..., None]; a model that pools or flattens over the batch axis must keep it."
        )


def check_positive(**values: int | None) -> None:
    """Raises naming the first argument that is neither ``None`` (where allowed) nor a positive
    integer: ``epochs`` must be given (0 allowed, as in Keras), the others may be ``None``."""
    for name, value in values.items():
        if value is None and name != "epochs":
            continue
        least = 0 if name == "epochs" else 1  # Keras's fit(epochs=0) trains nothing and returns
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
            allowed = "a non-negative integer" if name == "epochs" else "a positive integer or None"
            raise ValueError(f"{name} must be {allowed}; received {name}={value!r}.")
