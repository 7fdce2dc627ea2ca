"""Checks of host inputs that would otherwise train on the wrong thing without a word, or fail
later with a framework error: non-numeric features, sample weights of the wrong shape or sign,
sparse labels outside the classes, targets whose shape does not match the model's output.
Each raises a ``ValueError`` saying what was received and what to do, before compiling.

>>> import numpy as np
>>> sample_weights(np.ones((3, 1)), 3).shape           # (N, 1) is squeezed, as Keras does
(3,)
>>> sample_weights(np.array([1.0, -1.0]), 2)
Traceback (most recent call last):
...
ValueError: sample_weight[1] is -1.0: sample weights must be finite and non-negative.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from trainkit.core.tree import PyTree, Shape


class SettingError(ValueError):
    """trainkit's refusal of one of its own arguments for this model (``params=``, ``trainable=``,
    an optimizer per group), found while the model's variables are traced: raised as it is, never
    wrapped as an error of the model's call."""


def numeric(tree: PyTree, part: str) -> None:
    """Raises for a leaf of strings, objects or dates (only numbers and booleans train)."""
    if tree is None:
        return
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        kind = np.asarray(leaf).dtype.kind if not hasattr(leaf, "dtype") else np.dtype(leaf.dtype).kind
        if kind not in "biuf":
            raise ValueError(
                f"{part}{jax.tree_util.keystr(path)} has dtype {np.asarray(leaf).dtype} ({_KINDS.get(kind, kind)}); "
                "models take numbers. Encode it first (e.g. a vocabulary lookup for strings, "
                "np.asarray(values, np.float32) for Python objects)."
            )


_KINDS = {"U": "strings", "S": "bytes", "O": "Python objects", "M": "dates", "m": "time deltas", "c": "complex"}


def sample_weights(weights: Any, rows: int, part: str = "sample_weight") -> np.ndarray | None:
    """Float32 weights, finite and non-negative: one per row (``(N,)`` or ``(N, 1)``), or one per element of
    a row's loss (``(N, T, ...)``: per token, as Keras weights the timesteps of a ``(N, T, classes)``
    output; the step checks that the loss has that shape).

    >>> sample_weights(np.ones((2, 1)), 2).shape, sample_weights(np.ones((2, 5)), 2).shape
    ((2,), (2, 5))
    """
    if weights is None:
        return None
    if isinstance(weights, (dict, list, tuple)) and not np.isscalar(weights):
        raise ValueError(
            f"{part} must be one array with a weight per row (or per token), applied to every output; received a "
            f"{type(weights).__name__}. For per-output weights, override Trainer.compute_loss."
        )
    array = np.asarray(weights)
    if array.ndim == 2 and array.shape[1] == 1:
        array = array[:, 0]
    if array.ndim == 0 or array.shape[0] != rows:
        raise ValueError(
            f"{part} has shape {array.shape}; it needs one weight per row: shape ({rows},) or ({rows}, 1), or one "
            f"per token of each row's loss: ({rows}, T, ...)."
        )
    if array.dtype.kind not in "biuf":
        raise ValueError(f"{part} has dtype {array.dtype}; weights must be numbers.")
    array = array.astype(np.float32)
    bad = np.argwhere(~np.isfinite(array) | (array < 0))
    if bad.size:
        where = ", ".join(str(int(i)) for i in bad[0])
        raise ValueError(f"{part}[{where}] is {array[tuple(bad[0])]}: sample weights must be finite and non-negative.")
    return array


def sparse_labels(labels: np.ndarray, classes: int, where: str, ignored: int | None = None) -> None:
    """Raises naming the first label outside ``[0, classes)`` (the ``ignored`` class aside)."""
    labels = np.asarray(labels)
    outside = (labels < 0) | (labels >= classes)
    bad = np.flatnonzero(outside if ignored is None else outside & (labels != ignored))
    if bad.size:
        row = int(np.unravel_index(bad[0], labels.shape)[0]) if labels.ndim else 0
        raise ValueError(
            f"{where} holds label {labels.reshape(-1)[bad[0]]} (row {row}), but the model outputs {classes} classes: "
            f"labels must be in [0, {classes}). A label of -1 would silently count as the last class and one "
            f">= {classes} gives a NaN loss; drop those rows, give them sample_weight 0 after mapping them to 0, "
            "or widen the output layer."
        )


def not_one_hot(labels: np.ndarray, loss_name: str, where: str) -> None:
    """Raises when labels for a sparse (class-id) loss are one-hot rows (integers or bools,
    0 and 1 with a single 1 per row): they would be read as several class ids per example.

    >>> not_one_hot(np.array([0, 2, 1]), "sparse_categorical_crossentropy", "The labels y")
    """
    if labels.ndim < 2 or labels.shape[-1] < 2 or not (labels.dtype == bool or np.issubdtype(labels.dtype, np.integer)):
        return
    rows = labels.reshape(-1, labels.shape[-1]).astype(np.int64)
    if rows.size and np.isin(rows, (0, 1)).all() and (rows.sum(axis=-1) == 1).all():
        raise ValueError(
            f"{where} look one-hot (per-example shape {labels.shape[1:]}, a single 1 in each row of "
            f"{labels.shape[-1]}), but the loss {loss_name!r} takes one integer class id per example. Use "
            "loss='categorical_crossentropy' for one-hot labels, or pass the class ids: y.argmax(axis=-1)."
        )


def same_shape(targets_shape: Shape, outputs_shape: Shape, loss_name: str, where: str) -> None:
    """Per-example shapes of an element-wise loss's targets and outputs must match (``(B,)``
    against ``(B, 1)`` is accepted)."""
    if targets_shape == outputs_shape or (outputs_shape[-1:] == (1,) and targets_shape == outputs_shape[:-1]):
        return
    hint = (
        " Integer class ids need loss='sparse_categorical_crossentropy'."
        if len(targets_shape) == len(outputs_shape) - 1
        else ""
    )
    raise ValueError(
        f"{where} have per-example shape {targets_shape}, but the model outputs {outputs_shape}; "
        f"the loss {loss_name!r} compares them element by element.{hint}"
    )


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def byte_count(value: Any, name: str = "memory_limit") -> int | None:
    """A number of bytes given as an integer or as text with a unit (``"4GB"`` is 4e9,
    ``"4GiB"`` 4 * 2**30); ``None`` stays ``None``.

    >>> byte_count("4GiB"), byte_count("1.5 MB"), byte_count(2**20)
    (4294967296, 1500000, 1048576)
    >>> byte_count("four")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: memory_limit must be a positive number of bytes, e.g. 4 * 2**30 or "4GiB" ...; received 'four'.
    """
    import math
    import re

    if value is None:
        return None
    count: float | None = None
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", value, re.IGNORECASE)
        if match:
            count = float(match[1]) * _UNITS[(match[2] or "").lower()]
    elif isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        count = float(value)
    if count is None or not math.isfinite(count) or count < 1:
        raise ValueError(
            f'{name} must be a positive number of bytes, e.g. 4 * 2**30 or "4GiB" ("GB" is 10**9, "GiB" '
            f"2**30); received {value!r}."
        )
    return int(count)


def fraction(value: Any, name: str) -> float:
    """``value`` as a fraction in ``[0, 1)``, or a ``ValueError`` naming ``name`` and what it takes.

    >>> fraction(0.05, "headroom")
    0.05
    >>> fraction(5, "headroom")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: headroom must be a fraction in [0, 1) (0.05 keeps 5% free); received 5.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a fraction in [0, 1) (0.05 keeps 5% free); received {value!r}.")
    return float(value)


#: what XLA's errors say when a program does not fit the device's memory
_OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "Ran out of memory")


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is a device's out-of-memory error (XLA's ``RESOURCE_EXHAUSTED``, raised by
    a TPU's compiler or a GPU's allocator: a ``jax.errors.JaxRuntimeError``) that trainkit has not
    named yet. Another error that mentions memory (a data loader's, a callback's) is its own.

    >>> out_of_memory(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm"))
    True
    >>> out_of_memory(RuntimeError("CUDA out of memory in the data loader's worker"))
    False
    """
    message = str(error)
    return isinstance(error, jax.errors.JaxRuntimeError) and any(s in message for s in _OUT_OF_MEMORY)


class OutOfMemory(MemoryError):
    """A step that does not fit the device's memory, with what fits (raised by
    :mod:`trainkit.program.out_of_memory`, which finds what fits; ``tk.OutOfMemory``).

    Attributes:
        kind: the step: ``"train"``, ``"eval"`` or ``"predict"``.
        batch_size: the global batch it was given.
        needed: its per-device bytes (``None``: the device's error did not say).
        available: the device's bytes.
        fits_at: the largest batch that fits (``None``: not even the smallest).
        measure: the memory measure under which this batch fits (``None``: none of them).
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str,
        batch_size: int,
        needed: int | None,
        available: int,
        fits_at: int | None,
        measure: str | None,
    ):
        super().__init__(message)
        self.kind, self.batch_size, self.needed, self.available = kind, batch_size, needed, available
        self.fits_at, self.measure = fits_at, measure
