"""Metric totals: the exact masked reduction of per-batch metrics, on the device and the host.

Inside a step each metric becomes a :class:`WeightedAverage` (a ``clu.metrics.Average`` whose
count is the sum of the row weights, so padded rows with weight 0 never count), or the state a
:class:`BatchMetric` builds itself. Totals and counts are summed across devices and steps and
divided once at the end: the result does not depend on the device count or on how the data was
split into batches.

>>> import numpy as np
>>> a = WeightedAverage.from_values(np.array([1.0, 3.0, 100.0]), np.array([1.0, 1.0, 0.0]))
>>> float(a.merge(WeightedAverage.from_values(np.array([5.0]), np.array([1.0]))).compute())
3.0
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Self

import clu.metrics
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import PyTreeDef

from trainkit.core.tree import ArrayValue, KeyPath, PyTree

MetricFn = Callable[[PyTree, PyTree], jax.Array]


@flax.struct.dataclass
class WeightedAverage(clu.metrics.Average):
    """``clu.metrics.Average`` with real-valued row weights (sample weights times the mask)."""

    @classmethod
    def empty(cls) -> WeightedAverage:
        return cls(total=jnp.array(0, jnp.float32), count=jnp.array(0, jnp.float32))

    @classmethod
    def from_values(cls, values: jax.Array, weights: jax.Array) -> WeightedAverage:
        """``total = sum(values * weights)`` (rows of weight 0 are dropped even if not finite)."""
        xp = jnp if isinstance(values, jax.Array) else np
        weighted = xp.where(weights > 0, values * weights, 0)
        return cls(total=weighted.sum(), count=weights.sum())


class Weighted:
    """A metric that the sample weights apply to (Keras's ``weighted_metrics=``); metrics given
    as ``metrics=`` count every real row once, whatever its sample weight."""

    def __init__(self, fn: MetricFn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, predictions, targets):
        return self.fn(predictions, targets)


@flax.struct.dataclass
class LossAverage(WeightedAverage):
    """A loss: ``sum(loss * sample_weight)`` over the real rows, divided by the number of real
    rows (Keras's ``sum_over_batch_size``); NaN when no row counted."""


class BatchMetric:
    """Base class of a metric that builds its own batch state (a ``clu.metrics.Metric``) instead
    of a per-row mean: ``batch_state(predictions, targets, *, mask, weights)``, where ``mask``
    says which rows count (the sample weights for a :class:`Weighted` metric)."""

    def batch_state(self, predictions, targets, *, mask, weights) -> clu.metrics.Metric:
        raise NotImplementedError


def per_row(fn: MetricFn, predictions: PyTree, targets: PyTree) -> jax.Array:
    """``fn(predictions, targets)`` as one value per row: a function that returns the batch's
    mean (a scalar, which would count the padded rows of a last partial batch) is evaluated row
    by row instead (``jax.vmap`` over batches of one: exact for a mean over rows, decided when
    the step is traced, free per step).

    >>> import numpy as np
    >>> per_row(lambda p, t: jnp.mean(p == t), np.array([1, 2, 3]), np.array([1, 0, 3])).tolist()
    [1.0, 0.0, 1.0]
    """
    values = jnp.asarray(fn(predictions, targets))
    if values.ndim == 0:
        one_row = lambda p, t: fn(jax.tree.map(lambda a: a[None], p), jax.tree.map(lambda a: a[None], t))  # noqa: E731
        values = jnp.asarray(jax.vmap(one_row)(predictions, targets))
    return values


def batch_state(fn: MetricFn, predictions, targets, *, mask, weights) -> clu.metrics.Metric:
    """One batch's state of the metric ``fn``: a :class:`WeightedAverage` of its per-row values
    (rows counted by ``weights`` for a :class:`Weighted` metric, else once each), or the state a
    :class:`BatchMetric` builds itself."""
    inner, counted = (fn.fn, weights) if isinstance(fn, Weighted) else (fn, mask)
    if isinstance(inner, BatchMetric):
        return inner.batch_state(predictions, targets, mask=counted, weights=weights)
    values = per_row(fn, predictions, targets).astype(jnp.float32)
    return WeightedAverage.from_values(values.reshape(mask.shape[0], -1).mean(axis=1), counted)


def compute(totals: dict[str, clu.metrics.Metric], order: Sequence[str] = ("loss",)) -> dict[str, float]:
    """Python floats ``total / count`` for each metric (a ``WeightedAverage`` or a
    ``clu.metrics.LastValue``), the names in ``order`` first (pytrees sort dict keys; logs keep
    the user's order); names starting with ``_`` are trainkit's own probes, not logged. Where
    nothing was counted, a metric is 0.0 (Keras's ``divide_no_nan``, e.g. all sample weights
    zero) and the loss is NaN (a skipped fp16 step is not an observation).

    >>> compute({"loss": WeightedAverage.empty(), "mae": WeightedAverage.empty()})
    {'loss': nan, 'mae': 0.0}
    """
    names = [n for n in order if n in totals] + [n for n in totals if n not in order and not n.startswith("_")]

    def value(name):
        metric = totals[name]
        if not isinstance(metric, (WeightedAverage, clu.metrics.LastValue)):
            return float(metric.compute())  # a stateful metric's totals
        if float(metric.count):
            return float(metric.total / metric.count)
        return float("nan") if name == "loss" or isinstance(metric, LossAverage) else 0.0

    return {name: value(name) for name in names}


def merge(a: dict[str, clu.metrics.Metric] | None, b: dict[str, clu.metrics.Metric]):
    """Merges two dicts of averages (``a`` may be ``None``); runs once per step on the host,
    so averages are added directly (clu's ``merge`` checks shapes first, at 5x the cost)."""
    if a is None:
        return b

    def one(left, right):
        if isinstance(left, WeightedAverage) and type(left) is type(right):
            return type(left)(total=left.total + right.total, count=left.count + right.count)
        return left.merge(right)

    return {k: one(a[k], b[k]) for k in b}


def merge_stacked(totals: dict[str, clu.metrics.Metric] | None, stacked: dict[str, clu.metrics.Metric], steps: int):
    """Merges the host metrics of ``steps`` steps stacked on a leading axis (one fused call):
    averages summed over the axis, the last value kept, any other metric merged step by step.

    >>> stacked = {"loss": LossAverage(total=np.array([1.0, 3.0]), count=np.array([2.0, 2.0]))}
    >>> compute(merge_stacked(None, stacked, 2), ("loss",))
    {'loss': 1.0}
    """
    merged = {}
    for name, metric in stacked.items():
        if isinstance(metric, WeightedAverage):
            merged[name] = type(metric)(total=metric.total.sum(0), count=metric.count.sum(0))
        elif isinstance(metric, clu.metrics.LastValue):
            merged[name] = jax.tree.map(lambda a: a[-1], metric)
        else:
            for index in range(steps):
                step = jax.tree.map(lambda a, i=index: a[i], metric)
                merged[name] = step if index == 0 else merged[name].merge(step)
    return merge(totals, merged)


#: Steps in a row that counted no row (fp16 skipped them) before the loop warns.
SKIPPED_WARNING = 25


@flax.struct.dataclass
class EpochTotals:
    """The metric totals of the steps so far in an epoch (or an evaluation), kept on the device:
    the compiled step merges each step's metrics into it, and the host reads it only when
    something needs the logs. It also watches, without a host read per step, for what the
    loop warns about: the first non-finite loss and runs of skipped (fp16) steps.

    Indices count the steps merged, from 1; 0 means "none".

    >>> import numpy as np
    >>> carry = EpochTotals.empty({"loss": LossAverage(total=np.float32(0), count=np.float32(0))})
    >>> for total in (2.0, np.nan, 4.0):
    ...     carry = carry.add({"loss": LossAverage(total=jnp.float32(total), count=jnp.float32(2))})
    >>> int(carry.steps), int(carry.first_non_finite), float(carry.first_non_finite_loss)
    (3, 2, nan)
    """

    if TYPE_CHECKING:  # flax.struct.dataclass adds it

        def replace(self, **changes: object) -> Self: ...

    metrics: dict[str, PyTree]
    steps: jax.Array  # steps merged
    first_non_finite: jax.Array  # the first step whose loss (or, logged, gradient norm) was not finite
    first_non_finite_loss: jax.Array  # its loss (finite when the gradient norm was not)
    # under a loss scale only (``None`` otherwise: no leaves, nothing computed per step)
    skipped_run: jax.Array | None = None  # steps in a row, up to the last one merged, that counted no row
    skipped_alarm: jax.Array | None = None  # the step at which such a run first reached SKIPPED_WARNING
    skipped_scale: jax.Array | None = None  # the loss scale at that step

    @classmethod
    def empty(cls, metrics_spec: PyTree) -> EpochTotals:
        """Host zeros for metrics shaped as ``metrics_spec`` (one step's metrics or their
        ``jax.eval_shape``)."""
        zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), metrics_spec)
        counter: Any = np.int32(0)  # host zeros where the step carries device arrays
        zero: Any = np.float32(0)
        skipped = (counter, counter, zero) if "loss_scale" in metrics_spec else (None, None, None)
        return cls(zeros, counter, counter, zero, *skipped)

    def continuing(self, skipped_run: int) -> EpochTotals:
        """These totals with a run of skipped steps carried over from the last epoch."""
        return self if self.skipped_run is None else self.replace(skipped_run=np.int32(skipped_run))

    def add(self, metrics: dict[str, PyTree]) -> EpochTotals:
        """This carry with one more step's metrics merged (pure and traceable: it runs inside
        the compiled step). A metric's first step replaces the zeros, so a merge needs no
        identity element (``LastValue``, a maximum); a metric the carry holds and the step does
        not report is kept as it is."""
        index = self.steps + 1
        merged = merge(self.metrics, metrics)
        started = self.steps > 0
        first_or_merged = lambda m, b: jnp.where(started, m, b)  # noqa: E731 - for zeros that are no identity
        merged = {
            name: metric
            if _zeros_merge_as_identity(metrics[name])
            else jax.tree.map(first_or_merged, metric, metrics[name])
            for name, metric in merged.items()
        }
        # a metric this step does not report (statistics measured on other steps) is carried as it is
        merged.update({name: metric for name, metric in (self.metrics or {}).items() if name not in metrics})
        loss = metrics["loss"] if "loss" in metrics else _watched(metrics)
        value = loss.total / jnp.maximum(loss.count, 1.0)
        bad = ~jnp.isfinite(loss.total)
        norm = metrics.get(GRAD_NORM)
        if isinstance(norm, WeightedAverage):  # computed anyway: a NaN gradient behind a finite loss, at its step
            bad = bad | ~jnp.isfinite(norm.total)
        new_bad = (self.first_non_finite == 0) & bad
        run, alarm, scale = self.skipped_run, self.skipped_alarm, self.skipped_scale
        if "loss_scale" in metrics:  # a loss scale skips steps with non-finite gradients
            assert run is not None and alarm is not None and scale is not None  # carried with a loss scale
            run = jnp.where(loss.count == 0, run + 1, 0)
            raised = (alarm == 0) & (run == SKIPPED_WARNING)
            alarm = jnp.where(raised, index, alarm)
            scale = jnp.where(raised, metrics["loss_scale"].compute().astype(jnp.float32), scale)
        return EpochTotals(
            merged,
            index,
            jnp.where(new_bad, index, self.first_non_finite),
            jnp.where(new_bad, value, self.first_non_finite_loss).astype(jnp.float32),
            run,
            alarm,
            scale,
        )


def _zeros_merge_as_identity(metric: PyTree) -> bool:
    """Whether zeros of ``metric``'s type merge with a step's state as an identity, so an epoch's
    first step needs no select: a :class:`WeightedAverage`'s ``0 + x`` and a :class:`LabelAlarm`
    of count 0 (it takes the other's value and step). On a TPU every selected scalar is work at
    every step of a fused call (the dispatch MLP's k=128 call: 0.63 -> 0.72 of a hand scan)."""
    return isinstance(metric, (WeightedAverage, LabelAlarm))


def _watched(metrics: dict[str, PyTree]) -> LossAverage:
    """What stands for the loss in a step without one (a custom ``train_step``'s logs): the sum of
    its logs, non-finite when any is."""
    logs = [metric for _, metric in sorted(metrics.items()) if isinstance(metric, LossAverage)]
    if not logs:
        return LossAverage(total=jnp.float32(0), count=jnp.float32(0))
    return LossAverage(total=sum(metric.total for metric in logs), count=logs[0].count)


#: The global gradient norm's metric (``Trainer(log_grad_norm=True)``): when the step logs it, a step whose
#: gradient is not finite behind a finite loss counts as the epoch's first non-finite step.
GRAD_NORM = "grad_norm"

#: The metric under which a train step reports labels outside the classes (not logged: ``_``).
LABEL_ALARM = "_labels_out_of_range"


@flax.struct.dataclass
class LabelAlarm(clu.metrics.Metric):
    """Labels outside the classes seen by the steps merged: how many, one of them, and the
    (global) step that saw the first (``count == 0``: none).

    >>> none, bad = LabelAlarm.none(), LabelAlarm(jnp.int32(2), jnp.int32(-1), jnp.int32(7))
    >>> merged = none.merge(bad).merge(LabelAlarm(jnp.int32(1), jnp.int32(9), jnp.int32(8)))
    >>> int(merged.count), int(merged.value), int(merged.step)
    (3, -1, 7)
    """

    count: jax.Array
    value: jax.Array
    step: jax.Array

    @classmethod
    def none(cls) -> LabelAlarm:
        return cls(jnp.int32(0), jnp.int32(0), jnp.int32(0))

    def merge(self, other: LabelAlarm) -> LabelAlarm:
        first = self.count > 0
        return LabelAlarm(
            self.count + other.count, jnp.where(first, self.value, other.value), jnp.where(first, self.step, other.step)
        )

    def compute(self) -> jax.Array:
        return self.count


@flax.struct.dataclass
class PackedTotals:
    """:class:`EpochTotals` as one unsigned-integer array per item size (all of them one
    ``uint32`` array when every leaf takes 4 bytes), each leaf's bits in place: the form the
    compiled steps take and return. On a dispatch-bound step XLA pays for every buffer a call
    takes and returns (about 1.5 us each on a CPU), and the totals are a handful of scalars of
    two or three dtypes. ``layout`` (static) says where each leaf lives.

    >>> import numpy as np
    >>> totals = EpochTotals.empty({"loss": LossAverage(total=np.float32(0), count=np.float32(0))})
    >>> packed = pack(totals)
    >>> [(a.shape, a.dtype.name) for a in packed.arrays], int(packed.unpack().steps)
    ([((5,), 'uint32')], 0)
    """

    if TYPE_CHECKING:  # flax.struct.dataclass adds it

        def replace(self, **changes: object) -> Self: ...

    arrays: tuple[ArrayValue, ...]
    layout: Any = flax.struct.field(pytree_node=False)  # (treedef, ((array index, offset, shape, dtype), ...))

    def unpack(self) -> EpochTotals:
        """The totals, as NumPy or traced arrays like the packed ones."""
        treedef, places = self.layout
        leaves = []
        for index, offset, shape, dtype in places:
            bits = self.arrays[index][offset : offset + math.prod(shape)]  # math.prod: 10x np.prod's speed
            leaves.append(_from_bits(bits, np.dtype(dtype)).reshape(shape))
        totals: EpochTotals = jax.tree.unflatten(treedef, leaves)
        return totals

    def read_metric(self, name: str) -> PyTree:
        """The metric ``name`` as NumPy values, reading only the arrays that hold it (one small
        array for a metric packed apart, :data:`APART`) and unpacking nothing else."""
        treedef, places = self.layout
        indices, structure = _metric_leaves(treedef, name)
        host = {places[i][0]: np.asarray(self.arrays[places[i][0]]) for i in indices}
        leaves = []
        for index, offset, shape, dtype in (places[i] for i in indices):
            leaves.append(_from_bits(host[index][offset : offset + math.prod(shape)], np.dtype(dtype)).reshape(shape))
        return jax.tree.unflatten(structure, leaves)

    def block_until_ready(self) -> PackedTotals:
        """Waits for the step that computed these (its outputs are ready together)."""
        jax.block_until_ready(self.arrays[0])
        return self


#: prefixes of the metrics packed in arrays of their own: reported on some steps only (the
#: statistics, :mod:`trainkit.core.statistics`), so that a step that does not report them passes
#: their array through whole instead of slicing it out of and back into the others
APART = ("_stats/",)


@functools.lru_cache(maxsize=64)
def _metric_leaves(treedef: PyTreeDef, name: str) -> tuple[tuple[int, ...], PyTreeDef]:
    """The indices of metric ``name``'s leaves among the totals' leaves, and its structure."""
    metric = _numbered(treedef).metrics[name]
    return tuple(jax.tree.leaves(metric)), jax.tree.structure(metric)


def _numbered(treedef: PyTreeDef) -> EpochTotals:
    """Totals of ``treedef`` whose leaves are their own indices (which leaves a metric holds)."""
    numbered: EpochTotals = jax.tree.unflatten(treedef, range(treedef.num_leaves))
    return numbered


#: where packed totals' leaves live: their structure, and each leaf's (array, offset, shape, dtype)
Layout = tuple[PyTreeDef, tuple[tuple[int, int, tuple[int, ...], str], ...]]


@functools.lru_cache(maxsize=16)
def without_apart(layout: Layout) -> tuple[int, Layout]:
    """For packed totals of ``layout``: how many of their arrays (the first ones) hold the metrics
    not packed apart (:data:`APART`), and the layout of those alone (what a step that reports
    none of the others takes: :class:`trainkit.loop.measuring.SetAside`)."""
    treedef, places = layout
    numbered = _numbered(treedef)
    kept = numbered.replace(metrics={k: m for k, m in numbered.metrics.items() if not k.startswith(APART)})
    indices, kept_def = jax.tree.flatten(kept)
    count = len({places[i][0] for i in indices})
    assert all(places[i][0] < count for i in indices)  # pack() puts the arrays apart last
    return count, (kept_def, tuple(places[i] for i in indices))


def _storage(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.uint8) if dtype == np.bool_ else np.dtype(f"uint{8 * dtype.itemsize}")


def _to_bits(leaf: ArrayValue, storage: np.dtype) -> jax.Array | np.ndarray:
    """A leaf flattened, its bits as ``storage`` (bool as 0 / 1)."""
    if isinstance(leaf, (np.ndarray, np.generic)):
        host = np.ascontiguousarray(leaf).reshape(-1)
        return host.astype(storage) if host.dtype == np.bool_ else host.view(storage)
    flat = jnp.reshape(leaf, (-1,))
    return flat.astype(storage) if flat.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(flat, storage)


def _from_bits(bits: jax.Array | np.ndarray, dtype: np.dtype) -> jax.Array | np.ndarray:
    if isinstance(bits, np.ndarray):
        return bits != 0 if dtype == np.bool_ else bits.view(dtype)
    return bits != 0 if dtype == np.bool_ else jax.lax.bitcast_convert_type(bits, dtype)


def _apart(path: KeyPath) -> bool:
    """Whether a leaf at ``path`` in the totals belongs to a metric packed apart (:data:`APART`)."""
    return any(isinstance(key, jax.tree_util.DictKey) and str(key.key).startswith(APART) for key in path)


def pack(totals: EpochTotals) -> PackedTotals:
    """``totals`` as :class:`PackedTotals` (pure and traceable; NumPy in, NumPy out). The
    metrics named with an :data:`APART` prefix go in arrays of their own, after the others."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(totals)
    leaves = [leaf for _, leaf in with_paths]
    groups = [(_apart(path), _storage(np.dtype(leaf.dtype))) for path, leaf in with_paths]
    keys = sorted(set(groups), key=lambda group: (group[0], str(group[1])))
    xp = np if all(isinstance(leaf, (np.ndarray, np.generic)) for leaf in leaves) else jnp
    places: list[tuple[int, int, tuple[int, ...], str]] = []
    parts: list[list[ArrayValue]] = [[] for _ in keys]
    sizes = [0] * len(keys)
    for leaf, group in zip(leaves, groups, strict=True):
        dtype, index = np.dtype(leaf.dtype), keys.index(group)
        places.append((index, sizes[index], tuple(np.shape(leaf)), dtype.str))
        sizes[index] += math.prod(np.shape(leaf))
        parts[index].append(_to_bits(leaf, group[1]))
    arrays = tuple(xp.concatenate(group) for group in parts)
    return PackedTotals(arrays, (treedef, tuple(places)))
