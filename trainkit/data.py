"""Host-side batching: arrays or iterables -> fixed-shape NumPy batches with a row mask.

Every batch has the same static shape. The last partial batch is padded with zero rows whose
``mask`` is 0, so no sample is dropped, none counts twice and nothing recompiles.

>>> import numpy as np
>>> data = as_dataset((np.arange(10.0)[:, None], np.arange(10)))
>>> [int(b["mask"].sum()) for b in data.batches(4, shuffle=False)]
[4, 4, 2]
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from trainkit import checks

PyTree = Any
Batch = dict[str, Any]


def _is_array(obj: Any) -> bool:
    return isinstance(obj, (np.ndarray, jax.Array)) or (hasattr(obj, "__array__") and hasattr(obj, "shape"))


def is_array_tree(obj: Any) -> bool:
    """An array, a non-empty dict of array trees, or a non-empty list / tuple of arrays or dicts
    (Keras's multi-input ``x``; a list of tuples is an iterable of ``(x, y)`` batches)."""
    if _is_array(obj):
        return True
    if isinstance(obj, dict) and obj:
        return all(is_array_tree(v) for v in obj.values())
    if isinstance(obj, (list, tuple)) and obj:
        return all(_is_array(v) or isinstance(v, dict) and is_array_tree(v) for v in obj)
    return False


def split_xyw(element: Any) -> tuple[PyTree, PyTree, PyTree]:
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
        return tuple(element) + (None,) * (3 - len(element))  # type: ignore[return-value]
    return element, None, None


def host_array(a: Any) -> Any:
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


def example_spec(x: PyTree) -> PyTree:
    """Per-example shapes and dtypes of a batch of inputs (leading axis dropped)."""
    return jax.tree.map(lambda a: (tuple(a.shape[1:]), np.dtype(a.dtype).name), x)


def _check_lengths(parts: dict[str, PyTree]) -> int:
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
        raise ValueError("The dataset is empty (0 rows); pass at least one example.")
    return n


def _map(fn, tree: PyTree) -> PyTree:
    """``jax.tree.map`` with a shortcut for one array, the common case: per batch, the tree
    walk would cost more than the copy of a small batch."""
    return fn(tree) if isinstance(tree, np.ndarray) else jax.tree.map(fn, tree)


def _take(tree: PyTree, rows: np.ndarray | slice) -> PyTree:
    return _map(lambda a: np.asarray(a[rows]), tree)


def pad_batch(x, y, w, batch_size: int) -> Batch:
    """A batch dict padded with zero rows to ``batch_size`` and a float ``mask`` of real rows."""
    n = num_rows(x)
    pad = batch_size - n

    def padded(a):
        a = np.asarray(a)
        return a if pad == 0 else np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)])

    batch: Batch = {"x": _map(padded, x)}
    if y is not None:
        batch["y"] = _map(padded, y)
    if w is not None:
        batch["sample_weight"] = padded(np.asarray(w, np.float32))
    mask = np.zeros(batch_size, np.float32)
    mask[:n] = 1.0
    batch["mask"] = mask
    return batch


def check_shuffle(shuffle: Any) -> None:
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
    for lo in range(start * batch_size, n, batch_size):
        if order is None:  # a slice (a view) of the unshuffled rows
            yield slice(min(lo + mine.start, n), min(lo + mine.stop, lo + batch_size, n))
        else:
            yield order[lo : lo + batch_size][mine]


class ArrayDataset:
    """In-memory arrays, batched in a (seeded) shuffled order, last batch padded."""

    def __init__(self, x: PyTree, y: PyTree = None, sample_weight: PyTree = None):
        x, y, sample_weight = to_host(x), to_host(y), to_host(sample_weight)
        self.num_examples = _check_lengths({"x": x, "y": y, "sample_weight": sample_weight})
        self.x, self.y = x, y
        checks.numeric(self.x, "x")
        checks.numeric(self.y, "y")
        self.sample_weight = checks.sample_weights(sample_weight, self.num_examples)

    @property
    def has_targets(self) -> bool:
        return self.y is not None

    def element_spec(self) -> PyTree:
        return example_spec(self.x)

    def first(self, rows: int = 1) -> tuple[PyTree, PyTree, PyTree]:
        sl = slice(0, rows)
        return _take(self.x, sl), None if self.y is None else _take(self.y, sl), None

    def steps(self, batch_size: int) -> int:
        return -(-self.num_examples // batch_size)

    def batches(
        self,
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        epoch: int = 0,
        start: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        **_: Any,
    ) -> Iterator[Batch]:
        """Batches of ``batch_size`` rows from batch index ``start`` on.

        With several processes, every process computes the same (seeded) order and yields only
        its part of each global batch: rows ``[p * b, (p + 1) * b)`` of the padded global batch,
        ``b = batch_size / process_count``, so the parts of all processes, in process order,
        are exactly the single-process batch."""
        local = batch_size // process_count
        for rows in batch_rows(
            self.num_examples, batch_size, shuffle, seed, epoch, start, process_index, process_count
        ):
            x, y, w = (None if t is None else _take(t, rows) for t in (self.x, self.y, self.sample_weight))
            yield pad_batch(x, y, w, local)


class IterableDataset:
    """Any iterable of batches; its first batch fixes the static batch size.

    A re-iterable (a list, or an object whose ``__iter__`` returns a fresh iterator) restarts
    every epoch; a one-shot iterator (a generator) is consumed across epochs, so give
    ``steps_per_epoch`` with it. An iterator with grain's ``get_state()`` / ``set_state()``
    is checkpointable: :meth:`get_state` is its position after the last batch read, and
    ``batches(state=...)`` continues from such a position without replaying batches.
    ``convert`` turns each element into ``x``, ``(x, y)`` or ``(x, y, sample_weight)``
    (an adapter's rule, such as a torch ``DataLoader``'s lists).
    """

    def __init__(self, iterable: Iterable, convert: Callable[[Any], Any] | None = None):
        self.iterable = iterable
        self.convert = convert or (lambda element: element)
        self.one_shot = iter(iterable) is iterable
        self._iterator = self._current = iter(iterable)
        self._peeked: list = []
        first = self._peek()
        if first is None:
            raise ValueError("The dataset is empty: its iterable yielded no batch.")
        x, y, w = self._split(first)
        self.batch_size = _check_lengths({"x": x, "y": y, "sample_weight": w})
        checks.numeric(x, "x")
        checks.numeric(y, "y")
        self._first = (x, y, w)

    def _split(self, element: Any) -> tuple[PyTree, PyTree, PyTree]:
        return tuple(map(to_host, split_xyw(self.convert(element))))  # type: ignore[return-value]

    def _peek(self):
        if not self._peeked:
            try:
                self._peeked.append(next(self._iterator))
            except StopIteration:
                return None
        return self._peeked[0]

    @property
    def has_targets(self) -> bool:
        return self._first[1] is not None

    @property
    def checkpointable(self) -> bool:
        """Whether the iterator saves and restores its own position (grain's iterators)."""
        return hasattr(self._current, "get_state") and hasattr(self._current, "set_state")

    def get_state(self) -> Any:
        """The iterator's position after the last batch read, JSON-serialisable (grain's
        ``DataLoader`` gives bytes: kept as text); ``None`` when it has none."""
        if not self.checkpointable:
            return None
        state = self._current.get_state()
        return {"bytes": state.decode("latin-1")} if isinstance(state, bytes) else state

    def element_spec(self) -> PyTree:
        return example_spec(self._first[0])

    def first(self, rows: int = 1) -> tuple[PyTree, PyTree, PyTree]:
        x, y, _ = self._first
        return _take(x, slice(0, rows)), None if y is None else _take(y, slice(0, rows)), None

    def steps(self, batch_size: int | None = None) -> int | None:
        try:
            return len(self.iterable)  # type: ignore[arg-type]
        except TypeError:
            return None

    def _elements(self, start: int, state: Any) -> Iterator:
        # Plain for-loops, not ``yield from``: closing this generator at an epoch's end must
        # not close a one-shot iterator that the next epoch continues.
        if state is not None and self.checkpointable:  # continue where the saved iterator stood
            if not self.one_shot:
                self._current = iter(self.iterable)
            self._peeked.clear()
            as_bytes = isinstance(state, dict) and set(state) == {"bytes"}  # see get_state
            self._current.set_state(state["bytes"].encode("latin-1") if as_bytes else state)
            source = self._current
        else:
            if self._peeked:  # the batch read to learn the shapes comes first
                self._current = self._iterator
                source = itertools.chain([self._peeked.pop()], self._iterator)
            else:
                self._current = source = self._iterator if self.one_shot else iter(self.iterable)
            source = itertools.islice(source, start, None)
        for element in source:  # noqa: UP028
            yield element

    def batches(
        self, batch_size: int | None = None, *, start: int = 0, split: bool = False, state: Any = None, **_: Any
    ) -> Iterator[Batch]:
        """The iterable's batches from batch ``start`` on (or from a saved iterator ``state``),
        padded to the first batch's size. With several processes, each process's iterable
        yields that process's part of every global batch. A larger batch than the first is an
        error in training (it would change what a step averages); with ``split`` (evaluate,
        predict: per-row results) it is cut into pieces of that size."""
        first_spec = example_spec((self._first[0], self._first[1]))
        for index, element in enumerate(self._elements(start, state), start):
            x, y, w = self._split(element)
            n = _check_lengths({"x": x, "y": y, "sample_weight": w})
            spec = example_spec((x, y))
            if spec != first_spec:
                raise ValueError(
                    f"Batch {index} of the iterable has (x, y) of per-example shapes and dtypes {spec}, "
                    f"but its first batch had {first_spec}. Every batch must have the same feature shapes (only the "
                    "number of rows may differ); pad or crop the features before batching."
                )
            w = checks.sample_weights(w, n, f"sample_weight of batch {index}")
            if n > self.batch_size and not split:
                raise ValueError(
                    f"A batch of {n} rows follows a first batch of {self.batch_size} rows. "
                    "Every batch of an iterable given to fit must have at most the first batch's size "
                    "(only a smaller, last batch is padded); evaluate and predict split larger ones."
                )
            for lo in range(0, n, self.batch_size):
                part = slice(lo, lo + self.batch_size)
                x_, y_, w_ = (None if t is None else _take(t, part) for t in (x, y, w))
                yield pad_batch(x_, y_, w_, self.batch_size)


Dataset = ArrayDataset | IterableDataset


def as_dataset(data: Any, y: PyTree = None, sample_weight: PyTree = None) -> Dataset:
    """Normalises Keras-style inputs: ``(x, y[, w])``, ``x, y``, an iterable of batches, or a
    data library's dataset (:func:`trainkit.sources.adapt`); a dataset is returned as it is.
    A dict is the model's inputs (Keras's rule), whatever its keys."""
    from trainkit import sources  # the adapters build on this module

    if isinstance(data, sources.DataSource) and y is None and sample_weight is None:
        return data
    if y is not None or sample_weight is not None:
        return ArrayDataset(data, y, sample_weight)
    adapted = sources.adapt(data)
    if adapted is not None:
        return adapted
    if isinstance(data, tuple):
        x, y, w = split_xyw(data)
        if not is_array_tree(x):
            raise TypeError(
                f"x must be an array or a dict of arrays; received {type(x).__name__}. "
                "For batches from a generator, pass the iterable itself as `data`."
            )
        return ArrayDataset(x, y, w)
    if is_array_tree(data):
        return ArrayDataset(data)
    if isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
        raise TypeError(
            f"Cannot train on data of type {type(data).__name__}. Pass a tuple (x, y) or "
            "(x, y, sample_weight) of arrays, x and y as two arguments, an iterable of such "
            "batches, or a dataset of grain, torch, Hugging Face or tf.data (see docs/data.md)."
        )
    return IterableDataset(data)


def check_batch_size(batch_size: int, shards: int, *, micro_batches: int = 1, what: str = "batch_size") -> None:
    """Raises if ``batch_size`` cannot be split evenly into ``shards`` device parts (each split
    again into ``micro_batches`` for gradient accumulation)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
        raise ValueError(f"{what}={batch_size!r}: it must be a positive integer.")
    parts = shards * micro_batches
    if batch_size % parts:
        lower = batch_size - batch_size % parts
        upper = lower + parts
        nearest = f"{lower} or {upper}" if lower > 0 else f"{upper}"
        into = f"{shards} devices" + (
            f" x {micro_batches} micro-batches (grad_accum_steps)" if micro_batches > 1 else ""
        )
        raise ValueError(
            f"{what}={batch_size} cannot be split evenly across {into} "
            f"({batch_size} / {parts} is not an integer). Use a multiple of {parts}: the "
            f"nearest valid sizes are {nearest}."
        )


def check_same_inputs(expected: PyTree, received: PyTree) -> None:
    """Raises when ``received`` per-example input shapes differ from those the model was
    initialised with (both from :func:`example_spec`)."""
    is_spec = lambda s: isinstance(s, tuple) and len(s) == 2 and isinstance(s[1], str)  # noqa: E731
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
    for path, (shape, _) in exp.items():
        other = got[path][0]
        if tuple(other) != tuple(shape):
            raise ValueError(
                f"{name(path)} has per-example shape {tuple(other)} (batch shape "
                f"(batch, {', '.join(map(str, other))})), but the model was initialised with "
                f"per-example shape {tuple(shape)}. Reshape the data to (batch, "
                f"{', '.join(map(str, shape))}), or build a new Trainer for the new shape."
            )


def prepare(
    data: Any, y: PyTree, sample_weight: PyTree, batch_size: int | None, *, needs_targets: bool
) -> tuple[Dataset, int]:
    """A dataset and the global batch size for one ``fit`` / ``evaluate`` / ``predict`` call:
    ``batch_size`` (default 32) for arrays; an iterable's own batches times the processes.
    Raises before compiling when targets are needed but missing, or an iterable's batches
    contradict ``batch_size``."""
    dataset = as_dataset(data, y, sample_weight)
    if needs_targets and not dataset.has_targets:
        hint = ""
        if isinstance(dataset, ArrayDataset) and isinstance(dataset.x, dict) and "y" in dataset.x:
            hint = (
                " A dict given as x is the model's inputs (Keras's rule), so {'x': ..., 'y': ...} is read as two "
                "inputs named 'x' and 'y'; pass the data as a tuple (x, y) instead."
            )
        raise ValueError(
            "The data has no targets: pass (x, y), (x, y, sample_weight) or x and y as two "
            f"arguments (or override compute_loss for a loss without targets).{hint}"
        )
    if isinstance(dataset, IterableDataset):
        if batch_size is not None and batch_size != dataset.batch_size:
            raise ValueError(
                f"batch_size={batch_size} was given, but the iterable yields batches of "
                f"{dataset.batch_size} rows; an iterable's batches set the batch size. "
                "Drop batch_size, or re-batch the iterable."
            )
        return dataset, dataset.batch_size * jax.process_count()  # each process yields its part
    return dataset, 32 if batch_size is None else batch_size


def sample_batch(dataset: Dataset, batch_size: int) -> Batch:
    """The dataset's first ``batch_size`` rows as one padded global batch (for planning)."""
    x, y, w = dataset.first(batch_size)
    return pad_batch(x, y, w, batch_size)


def check_positive(**values: int | None) -> None:
    """Raises naming the first argument that is neither ``None`` (where allowed) nor a positive
    integer: ``epochs`` must be given, the others may be ``None``."""
    for name, value in values.items():
        if value is None and name != "epochs":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            allowed = "a positive integer" if name == "epochs" else "a positive integer or None"
            raise ValueError(f"{name} must be {allowed}; received {name}={value!r}.")


def check_validation_runs(dataset: Dataset, runs: int, validation_steps: int | None) -> None:
    """A one-shot iterator (a generator) as ``validation_data`` serves one validation run, or
    several with ``validation_steps`` (each run continues it); refused up front otherwise."""
    if getattr(dataset, "one_shot", False) and runs > 1 and validation_steps is None:
        raise ValueError(
            f"validation_data is a one-shot iterator (such as a generator), but {runs} epochs validate: the second "
            "validation would find it exhausted. Pass a list or a re-iterable of batches, arrays, or "
            "validation_steps=N (each validation then reads the next N batches)."
        )


def epoch_steps(dataset: Dataset, batch_size: int, steps_per_epoch: int | None, epochs: int) -> int | None:
    """Batches per epoch: the data's, capped by ``steps_per_epoch``; ``None`` when unknown (an
    iterable without ``len``), which a one-shot iterator allows only for one epoch."""
    steps = dataset.steps(batch_size)
    if steps_per_epoch is not None:
        steps = steps_per_epoch if steps is None else min(steps, steps_per_epoch)
    if steps is None and getattr(dataset, "one_shot", False) and epochs > 1:
        raise ValueError(
            "A one-shot iterator (such as a generator) cannot be restarted, so with "
            "epochs > 1 pass steps_per_epoch=N to say where an epoch ends."
        )
    return steps


def _arrays_only(dataset: Dataset, what: str) -> ArrayDataset:
    if not isinstance(dataset, ArrayDataset):
        raise ValueError(
            f"{what} is only supported for arrays (x, y[, sample_weight]); received an iterable of batches. "
            "Split or weight the data before batching it, or pass validation_data / per-row sample weights."
        )
    return dataset


def split_validation(dataset: Dataset, validation_split: float) -> tuple[ArrayDataset, ArrayDataset]:
    """Keras's ``validation_split``: the last ``validation_split`` fraction of the rows (before
    any shuffling) becomes the validation set."""
    dataset = _arrays_only(dataset, "validation_split")
    if not 0.0 < validation_split < 1.0:
        raise ValueError(f"validation_split must be between 0 and 1; received {validation_split!r}.")
    n = dataset.num_examples
    split_at = int(np.floor(n * (1.0 - validation_split)))
    if split_at in (0, n):
        raise ValueError(
            f"Training data contains {n} samples, which is not sufficient to split it into a validation and "
            f"training set as specified by `validation_split={validation_split}`. Either provide more data, or a "
            "different value for the `validation_split` argument."
        )
    part = lambda tree, rows: None if tree is None else jax.tree.map(lambda a: a[rows], tree)  # noqa: E731
    train, val = slice(0, split_at), slice(split_at, n)
    return (
        ArrayDataset(part(dataset.x, train), part(dataset.y, train), part(dataset.sample_weight, train)),
        ArrayDataset(part(dataset.x, val), part(dataset.y, val), part(dataset.sample_weight, val)),
    )


def with_class_weight(dataset: Dataset, class_weight: dict) -> ArrayDataset:
    """Keras's ``class_weight``: every row weighted by its class (integer labels, ``(B, 1)``
    labels or one-hot targets), 1.0 for classes not in the dict."""
    dataset = _arrays_only(dataset, "class_weight")
    if not hasattr(class_weight, "items"):
        raise ValueError(f"class_weight must be a dict of class index -> weight; received {class_weight!r}.")
    if dataset.sample_weight is not None:
        raise ValueError(
            "You cannot use `class_weight` and `sample_weight` at the same time: fold the class "
            "weights into sample_weight."
        )
    if dataset.y is None or len(jax.tree.leaves(dataset.y)) != 1:
        raise ValueError("class_weight needs one array of targets; for several outputs pass sample_weight.")
    try:
        weights = {int(k): float(v) for k, v in class_weight.items()}
    except (TypeError, ValueError):
        raise ValueError(
            f"class_weight keys must be class indices (integers); received {list(class_weight)}."
        ) from None
    y = np.asarray(jax.tree.leaves(dataset.y)[0])
    if y.ndim > 1:
        y = np.argmax(y, axis=-1) if y.shape[-1] != 1 else y[..., 0]
    classes = np.round(y).astype(np.int64).reshape(len(y))
    sample_weight = np.array([weights.get(int(c), 1.0) for c in classes], np.float32)
    return ArrayDataset(dataset.x, dataset.y, sample_weight)


def continues_across_epochs(dataset: Dataset, batch_size: int, steps_per_epoch: int | None) -> bool:
    """Keras's rule: with ``steps_per_epoch`` below the batches of one pass (arrays, or a
    re-iterable with a length), the next epoch continues the pass (see :func:`epoch_batches`)."""
    if steps_per_epoch is None or getattr(dataset, "one_shot", False):
        return False
    per_pass = dataset.steps(batch_size)
    return per_pass is not None and steps_per_epoch < per_pass


def epoch_batches(
    dataset: Dataset,
    batch_size: int,
    epoch: int,
    first: int,
    steps: int | None,
    *,
    continuing: bool = False,
    **options: Any,
) -> Iterator[Batch]:
    """The batches of epoch ``epoch`` from batch ``first`` on, at most ``steps`` per epoch.

    ``continuing`` (Keras's ``steps_per_epoch`` smaller than the data): an epoch
    walks on through the pass the previous epoch left, and ends early where that pass ends;
    the next epoch starts a new pass, shuffled by its own index. Epoch ``e`` is thus the
    ``e % E``-th slice of ``steps`` batches of pass ``e // E`` (``E`` epochs per pass), so any
    position ``(epoch, batch)`` maps to one batch (exact resume).

    >>> data = ArrayDataset(np.arange(10.0)[:, None], np.arange(10))
    >>> [[b["y"][0].item() for b in epoch_batches(data, 2, e, 0, 4, continuing=True)] for e in range(3)]
    [[0, 2, 4, 6], [8], [0, 2, 4, 6]]
    """
    if not continuing:
        limit = None if steps is None else max(steps - first, 0)
        return itertools.islice(dataset.batches(batch_size, epoch=epoch, start=first, **options), limit)
    per_pass = dataset.steps(batch_size)
    passes, part = divmod(epoch, -(-per_pass // steps))
    start, end = part * steps + first, min((part + 1) * steps, per_pass)
    return itertools.islice(dataset.batches(batch_size, epoch=passes, start=start, **options), max(end - start, 0))
