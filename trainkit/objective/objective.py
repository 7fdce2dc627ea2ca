"""What a model is trained and judged on: the loss of each output (weighted by
``loss_weights`` and summed) and the metrics of each output, named in the logs as Keras 3
names them.

One output: ``loss`` is one loss and ``metrics`` a list. Several outputs (the model returns a
dict or a list/tuple, and the targets have the same structure): ``loss`` is one loss for
every output, a list with one entry per output, or a dict keyed by output name (an output
without a loss is left out); ``metrics`` is a dict ``{output: [metrics]}`` or a list with one
entry per output. Outputs are named by their dict keys, or ``output_0``, ``output_1``, ... for
a list. The logs hold ``loss`` (the weighted sum), ``<output>_loss`` (each output's loss,
without its weight) and ``<output>_<metric>``.

>>> import numpy as np, jax.numpy as jnp
>>> objective = Objective({"a": "mse", "b": "mae"}, metrics={"b": ["mse"]}, loss_weights={"a": 1.0, "b": 0.5})
>>> _ = objective.build({"a": np.zeros((1, 1)), "b": np.zeros((1, 1))})
>>> objective.log_order
('loss', 'a_loss', 'b_loss', 'b_mse')
>>> predictions = {"a": jnp.array([[2.0]]), "b": jnp.array([[2.0]])}
>>> objective.loss(predictions, {"a": jnp.array([[0.0]]), "b": jnp.array([[0.0]])}).tolist()   # 4 + 0.5 * 2
[5.0]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainkit.core import checks
from trainkit.core.totals import BatchMetric, MetricFn
from trainkit.core.tree import PyTree
from trainkit.objective import crossentropy, losses
from trainkit.objective import metrics as metrics_lib

#: An output's key in a dict or list of outputs (``None``: the only one).
OutputKey = str | int | None
#: ``(predictions, targets) -> (this output's predictions, its targets)``.
Picker = Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]


@dataclass(frozen=True)
class Output:
    """One output of the model: where it is in the outputs (``key``: a dict key, a list index,
    or ``None`` for a model with a single output), its name in the logs, its loss (per example)
    and loss weight, and whether the loss reads it as logits."""

    name: str
    key: OutputKey
    loss: losses.LossFn | None
    loss_name: str
    weight: float
    logits: bool
    ignore_class: int | None = None  # targets of this class count in no loss (Keras's ``ignore_class``)


def _pick(tree: PyTree, key: OutputKey, what: str) -> PyTree:
    if key is None:
        return tree
    try:
        return tree[key]
    except (KeyError, IndexError, TypeError):
        shape = jax.tree.map(lambda _: "*", tree)
        raise ValueError(
            f"The {what} have no output {key!r}: they are {shape}. A model with several outputs must return them in "
            "the structure of the targets (a dict with the same keys, or a list/tuple of the same length)."
        ) from None


def takes_logits(loss: object) -> bool:
    """Whether a loss reads the outputs as logits: a loss object says so (``from_logits``);
    trainkit's cross-entropy names and plain callables take logits; the other names
    (``"mse"``, ``"hinge"``, ...) and Keras objects read values (Keras's 0.5 thresholds)."""
    from_logits = getattr(loss, "from_logits", None)
    if from_logits is None and hasattr(loss, "_fn_kwargs"):  # keras.losses.LossFunctionWrapper
        from_logits = loss._fn_kwargs.get("from_logits")
    if from_logits is not None:
        return bool(from_logits)
    if isinstance(loss, str):
        return losses.LOSSES.get(loss) in losses.LOGITS_LOSSES
    return not losses.is_keras_object(loss)


def _as_list(spec: object) -> list[object]:
    if spec is None:
        return []
    return list(spec) if isinstance(spec, (list, tuple)) else [spec]


def _structure(targets: PyTree) -> tuple[str, list[OutputKey]]:
    """``("single", [None])``, ``("dict", sorted keys)`` or ``("list", indices)``."""
    if isinstance(targets, Mapping) and not isinstance(targets, np.ndarray):
        return "dict", sorted(targets)
    if isinstance(targets, (list, tuple)):
        return "list", list(range(len(targets)))
    return "single", [None]


#: ``Trainer(loss=...)``: a Keras name or a loss (object or callable), or one per output (a list, or a dict by name).
LossSpec = str | Callable[..., Any] | Sequence[str | Callable[..., Any] | None] | Mapping[str, object] | None
#: ``Trainer(metrics=...)``: names or metric objects, or by output (a dict of those).
MetricSpec = Sequence[str | Callable[..., Any]] | Mapping[str, object] | None


class Objective:
    """The losses and metrics of a model's outputs (see the module docstring). :meth:`build`
    fixes the outputs from the targets' structure; until then a single output is assumed."""

    def __init__(
        self,
        loss: LossSpec = None,
        metrics: MetricSpec = None,
        weighted_metrics: MetricSpec = None,
        loss_weights: float | Sequence[float] | Mapping[str, float] | None = None,
        own_loss: bool = False,
    ):
        """``own_loss``: a trainer's ``compute_loss`` of its own computes the loss; then ``loss`` and
        ``loss_weights`` count only if it calls :meth:`loss` (:meth:`check_used`)."""
        if loss_weights is not None and not isinstance(loss_weights, (int, float, list, tuple, dict)):
            raise ValueError(
                "loss_weights must be a float (one output), or a list or dict with one weight per output; "
                f"received {loss_weights!r} of type {type(loss_weights).__name__}."
            )
        self.spec = (loss, metrics, weighted_metrics, loss_weights)
        self.own_loss, self.loss_calls = own_loss, 0  # loss_calls: how often :meth:`loss` was traced
        self.structure: tuple[str, tuple[OutputKey, ...]] | None = None
        self.sparse_labels: dict[OutputKey, tuple[int, int]] = {}
        self.build(None)

    # ------------------------------------------------------------------ building
    def _loss_structure(self) -> PyTree:
        """Before any targets are seen: the outputs that a dict or list of losses (or of loss
        weights, or a dict of metrics) names."""
        loss, metrics, weighted_metrics, loss_weights = self.spec
        for spec in (loss, loss_weights, metrics, weighted_metrics):
            if isinstance(spec, dict):
                return dict.fromkeys(spec, np.zeros(1))
            if (
                isinstance(spec, (list, tuple))
                and len(spec) > 1
                and spec is not metrics
                and spec is not weighted_metrics
            ):
                return [np.zeros(1)] * len(spec)
        return None

    def build(self, targets: PyTree) -> Objective:
        """Resolves the outputs for targets of this structure (a dict, a list/tuple, or one
        array); a call with the same structure is a no-op. Raises for an unknown output name,
        a list of the wrong length, or nested outputs."""
        seen = targets
        targets = targets if targets is not None else self._loss_structure()
        kind, keys = _structure(targets)
        if kind != "single" and any(not hasattr(leaf, "shape") for leaf in jax.tree.leaves(targets)):
            raise ValueError("Targets must be arrays, or a dict or list of arrays (one per output).")
        if kind != "single" and any(isinstance(targets[k], (Mapping, list, tuple)) for k in keys):
            raise ValueError(
                "Nested outputs are not supported: give the targets as a flat dict or list with one array per output."
            )
        structure = (kind, tuple(keys))
        if structure == self.structure:
            return self
        if self.structure is not None and self.structure[0] != "single" and seen is not None:
            raise ValueError(
                f"The targets' structure changed from {self.structure} to {structure}; one Trainer trains one "
                "output structure. Make a new Trainer for the other one."
            )
        loss, metrics, weighted_metrics, loss_weights = self.spec
        names = [str(k) if kind == "dict" else f"output_{k}" for k in keys] if kind != "single" else [""]
        self.outputs = self._outputs(kind, keys, names, loss, loss_weights)
        self.sparse_labels = {}  # the sparse outputs' classes and label rank: check_targets fills it
        per_output = lambda spec, what: self._per_output(spec, names, what)  # noqa: E731
        self._metric_specs = (per_output(metrics, "metrics"), per_output(weighted_metrics, "weighted_metrics"))
        self._resolve_metrics()
        self.structure = structure if seen is not None else None
        return self

    def _outputs(self, kind, keys, names, loss, loss_weights) -> list[Output]:
        if kind == "single":
            if isinstance(loss, (list, tuple)) and len(loss) == 1:
                loss = loss[0]
            if isinstance(loss, dict):
                raise ValueError(
                    f"loss is a dict ({list(loss)}) but the targets are one array: give the targets as a dict "
                    "with the same keys (one array per output), or pass one loss."
                )
            if isinstance(loss_weights, (list, tuple)) and len(loss_weights) == 1:
                loss_weights = loss_weights[0]
            if isinstance(loss_weights, (list, tuple, dict)):
                raise ValueError(
                    f"loss_weights must be a float for a model with one output; received {loss_weights!r}."
                )
            losses_by_name, weights = {"": loss}, {"": 1.0 if loss_weights is None else float(loss_weights)}
        else:
            losses_by_name = self._per_output_values(loss, names, kind, "loss", broadcast=True)
            weights = self._per_output_values(loss_weights, names, kind, "loss_weights", broadcast=False)
            weights = {n: 1.0 if w is None else float(w) for n, w in weights.items()}
        outputs = []
        for name, key in zip(names, keys):
            spec = losses_by_name.get(name)
            fn = None if spec is None else losses.get_loss(spec)
            loss_name = str(
                spec if isinstance(spec, str) else getattr(spec, "name", None) or getattr(fn, "__name__", "loss")
            )
            logits = True if spec is None else takes_logits(spec)
            outputs.append(Output(name, key, fn, loss_name, weights[name], logits, losses.ignored_class(spec)))
        ignoring = [out.name or "the output" for out in outputs if out.ignore_class is not None]
        if ignoring and sum(out.loss is not None for out in outputs) > 1:
            raise ValueError(
                f"A loss with ignore_class ({', '.join(ignoring)}) on a model with several losses: trainkit weighs "
                "one output's tokens. Mask the other outputs' losses in a compute_loss of your own, or train apart."
            )
        return outputs

    def valid_tokens(self) -> Callable[[PyTree], jax.Array] | None:
        """``targets -> (rows, T, ...)`` 1.0 where a target is not the class the loss ignores (``None``: no
        loss ignores one): what the step weighs the tokens by (``core.step_helpers.with_ignored_tokens``)."""
        out = next((out for out in self.outputs if out.ignore_class is not None), None)
        if out is None or out.ignore_class is None:
            return None
        key, ignored = out.key, int(out.ignore_class)

        def valid_of(targets: PyTree) -> jax.Array:
            labels = jnp.asarray(_pick(targets, key, "targets"))
            valid: jax.Array = jnp.not_equal(labels, ignored).astype(jnp.float32)
            return valid

        return valid_of

    @staticmethod
    def _per_output_values(spec, names, kind, what, *, broadcast) -> dict[str, Any]:
        """A value per output name from a dict (missing names: ``None``), a list (one per
        output), or, with ``broadcast``, a single value for all."""
        if spec is None:
            return dict.fromkeys(names)
        if isinstance(spec, dict):
            unknown = [k for k in spec if str(k) not in names]
            if unknown:
                raise ValueError(
                    f"{what} names outputs {unknown} that the targets do not have; the outputs are {names}."
                )
            by_name = {str(k): v for k, v in spec.items()}
            return {n: by_name.get(n) for n in names}
        if isinstance(spec, (list, tuple)):
            if len(spec) != len(names):
                raise ValueError(
                    f"{what} is a list of {len(spec)} entries but the model has {len(names)} outputs ({names}); "
                    "give one entry per output (None for an output without one), or a dict by output name."
                )
            return dict(zip(names, spec))
        if broadcast:
            return dict.fromkeys(names, spec)
        raise ValueError(
            f"{what}={spec!r} is a single value but the model has {len(names)} outputs ({names}); "
            "give a list or a dict with one value per output."
        )

    @staticmethod
    def _per_output(spec: MetricSpec, names: list[str], what: str) -> dict[str, list[object]]:
        if len(names) == 1:  # one output: every metric applies to it (Keras)
            entries = spec.values() if isinstance(spec, dict) else _as_list(spec)
            return {names[0]: [metric for entry in entries for metric in _as_list(entry)]}
        if spec is None:
            return {n: [] for n in names}
        if isinstance(spec, dict) or (isinstance(spec, (list, tuple)) and len(spec) == len(names)):
            return {
                n: _as_list(v) for n, v in Objective._per_output_values(spec, names, "", what, broadcast=False).items()
            }
        raise ValueError(
            f"With {len(names)} outputs ({names}), {what} must be a dict {{output: [metrics]}} or a list with one "
            f"entry (a metric, a list of metrics, or None) per output; received {spec!r}."
        )

    def _resolve_metrics(self) -> None:
        metrics, weighted = self._metric_specs
        several = len(self.outputs) > 1
        prefix = lambda out, name: f"{out.name}_{name}" if several else name  # noqa: E731
        fns: dict[str, MetricFn | BatchMetric] = {}
        self.directions: dict[str, str | None] = {"loss": "min"}
        for out in self.outputs:
            select = self._selector(out)
            for name, fn in metrics_lib.get_metrics(metrics[out.name], logits=out.logits).items():
                fns[prefix(out, name)] = select(fn)
                self.directions[prefix(out, name)] = metrics_lib.direction(name, fn)
            for name, fn in metrics_lib.get_metrics(weighted[out.name], logits=out.logits).items():
                key = prefix(out, name)
                key = prefix(out, f"weighted_{name}") if key in fns else key
                fns[key], self.directions[key] = metrics_lib.Weighted(select(fn)), metrics_lib.direction(name, fn)
        terms: dict[str, Any] = {}
        if sum(out.loss is not None for out in self.outputs) > 1:
            loss = self.spec[0]  # Keras logs the outputs' losses in the order of a loss dict
            order = [str(k) for k in loss] if isinstance(loss, dict) else [out.name for out in self.outputs]
            for out in sorted(self.outputs, key=lambda o: order.index(o.name) if o.name in order else len(order)):
                if out.loss is not None:
                    terms[f"{out.name}_loss"] = metrics_lib.LossTerm(
                        self._selector(out)(losses.per_example(out.loss)), f"{out.name}_loss"
                    )
        self.metric_fns = {**terms, **fns}
        self.directions.update(dict.fromkeys(terms, "min"))
        self.log_order = ("loss", *terms, *(sorted(fns) if several else fns))

    @staticmethod
    def _selector(out: Output):
        """``fn(predictions, targets)`` on the whole structures -> ``fn`` on this output."""
        if out.key is None:
            return lambda fn: fn

        def select(fn):
            pick = functools.partial(_pick_output, out.key)
            return _StatefulOnOutput(fn, pick) if isinstance(fn, BatchMetric) else _OnOutput(fn, pick)

        return select

    # ------------------------------------------------------------------ using it
    @property
    def has_loss(self) -> bool:
        return any(out.loss is not None for out in self.outputs)

    def loss(self, predictions: PyTree, targets: PyTree, per_token: jax.Array | None = None) -> jax.Array:
        """Per-example ``sum(weight * loss)`` over the outputs with a loss; ``per_token``: sample weights of
        each element of an output's loss (``(rows, T)`` for ``(rows, T, classes)`` logits), applied before the
        mean over the elements (Keras's ``sum_over_batch_size``)."""
        self.loss_calls += 1
        total = None
        for out in self.outputs:
            if out.loss is None:
                continue
            what = "The loss" if out.key is None else f"The loss of output {out.key!r}"
            values = losses.per_example(out.loss, per_token, what)(
                _pick(predictions, out.key, "model's outputs"), _pick(targets, out.key, "targets")
            )
            values = values if out.weight == 1.0 else values * out.weight
            total = values if total is None else total + values
        if total is None:
            raise ValueError("No output has a loss: give loss=... (for at least one output).")
        return total

    def check_used(self, calls_before: int) -> None:
        """Raises when ``loss=`` or ``loss_weights=`` were given but the ``compute_loss`` of its own
        that just ran (traced) did not call :meth:`loss` since ``calls_before``: they would be ignored."""
        given = [f"{name}={value!r}" for name, value in (("loss", self.spec[0]), ("loss_weights", self.spec[3]))
                 if value is not None]  # fmt: skip
        if self.own_loss and given and self.loss_calls == calls_before:
            raise ValueError(
                f"{' and '.join(given)} given, but the trainer's compute_loss never computes that loss: it would be "
                "ignored. Remove it from the Trainer's arguments, or compute it in compute_loss with "
                "super().compute_loss(params, batch, rng, model_state=model_state, train=train) or "
                "self.objective.loss(predictions, batch['y'])."
            )

    def check_targets(self, targets: PyTree, outputs: PyTree = None, part: str = "y") -> None:
        """Raises before compiling, per output with a loss: float labels for a sparse loss; and
        given ``outputs`` (the model's output shapes, from ``jax.eval_shape``): labels outside
        the classes, or targets whose shape an element-wise loss cannot compare."""
        if targets is None:
            return
        if isinstance(targets, dict) and isinstance(outputs, dict):
            extra = sorted(set(map(str, targets)) - set(map(str, outputs)))
            if extra:
                raise ValueError(
                    f"The targets {part} have {extra}, which no output of the model has (its outputs are "
                    f"{sorted(map(str, outputs))}): they would be ignored. Remove them, or name them after an output "
                    "(a misspelt key?)."
                )
        for out in self.outputs:
            if out.loss is None:
                continue
            target = np.asarray(_pick(targets, out.key, "targets"))
            where = part + (f"[{out.key!r}]" if out.key is not None else "")
            shape = None if outputs is None else tuple(_pick(outputs, out.key, "model's outputs").shape[1:])
            loss = out.loss if shape is None else losses.concrete(out.loss, target.shape, target.shape[:1] + shape)
            if losses.is_sparse(loss) and shape in (None, target.shape[1:]):  # class ids have one axis less
                checks.not_one_hot(target, out.loss_name, f"The labels {where}")
            losses.check_targets(loss, target)
            if shape is None:
                continue
            if losses.is_sparse(loss):
                labels = target[..., 0] if target.ndim == len(shape) + 1 and target.shape[-1] == 1 else target
                checks.same_shape(labels.shape[1:], shape[:-1], out.loss_name, f"The labels {where}")
                checks.sparse_labels(labels, shape[-1], where, out.ignore_class)
                self.sparse_labels[out.key] = (shape[-1], len(shape))
            elif loss in losses.ELEMENTWISE_LOSSES or isinstance(loss, crossentropy.Loss):
                checks.same_shape(target.shape[1:], shape, out.loss_name, f"The targets {where}")

    def labels_out_of_range(self, targets: PyTree) -> tuple[jax.Array, jax.Array] | None:
        """Inside a step: how many class ids of the targets lie outside their output's classes,
        and one of them (the largest; 0 when none), for the outputs with a sparse loss that
        :meth:`check_targets` saw (``None``: none). The host checks the first batch of an
        iterable and every label of arrays; this checks every batch, where it trains."""
        if not self.sparse_labels:
            return None
        count, value = jnp.int32(0), jnp.int32(0)
        ignored = {out.key: out.ignore_class for out in self.outputs if out.ignore_class is not None}
        for key, (classes, rank) in self.sparse_labels.items():
            labels = jnp.asarray(_pick(targets, key, "targets"))
            labels = labels[..., 0] if labels.ndim == rank + 1 and labels.shape[-1] == 1 else labels
            labels = labels.reshape(-1).astype(jnp.int32)
            bad = (labels < 0) | (labels >= classes)
            if key in ignored:
                bad = bad & (labels != ignored[key])
            # the largest bad label and the count: two sibling reductions XLA fuses into one loop
            largest = jnp.where(bad, labels, jnp.iinfo(jnp.int32).min).max()
            value = jnp.where(count > 0, value, largest)
            count = count + bad.sum(dtype=jnp.int32)
        return count, jnp.where(count > 0, value, 0)

    def labels_message(self, count: int, value: int, where: str) -> str:
        """The error for :meth:`labels_out_of_range`'s finding in ``where`` (a batch)."""
        classes = sorted({classes for classes, _ in self.sparse_labels.values()})
        return (
            f"{where} holds {count} label(s) outside the model's classes (for example {value}; the outputs have "
            f"{' / '.join(map(str, classes))} classes): labels must be in [0, classes). A label of -1 trains as the "
            "last class and one past the classes gives a NaN loss. The first batch was checked before training; "
            "this one was found inside the step. Fix the data (drop those rows, or map them to a class with "
            "sample_weight 0), or widen the output layer."
        )

    def keras_result(self, logs: dict[str, float], return_dict: bool = False) -> float | list[float] | dict[str, float]:
        """Keras's return value of ``evaluate``: the dict, or the loss alone, or ``[loss,
        *metrics]`` in the compiled order.

        >>> objective = Objective("mse", ["mae"])
        >>> objective.keras_result({"mae": 2.0, "loss": 1.0}), objective.keras_result({"loss": 1.0})
        ([1.0, 2.0], 1.0)
        """
        if return_dict:
            return logs
        order = self.log_order
        values = [logs[k] for k in order if k in logs] + [v for k, v in sorted(logs.items()) if k not in order]
        return values[0] if len(values) == 1 else values

    @property
    def takes_logits(self) -> bool:
        """Whether an output's loss takes logits by definition (a cross-entropy by name, optax's)."""
        return any(out.loss in losses.LOGITS_LOSSES for out in self.outputs)

    def probability_outputs(self, predictions: PyTree) -> list[tuple[str, str]]:
        """``(loss, the loss object that reads probabilities)`` for each output whose loss takes
        logits but whose ``predictions`` (host values) all look like probabilities.

        >>> import numpy as np
        >>> Objective("sparse_categorical_crossentropy").probability_outputs(np.array([[0.3, 0.7], [0.5, 0.5]]))
        [("'sparse_categorical_crossentropy'", 'tk.losses.SparseCategoricalCrossentropy()')]
        """
        found = []
        for out in self.outputs:
            if out.loss is None or out.loss not in losses.LOGITS_LOSSES:
                continue
            outputs = _pick(predictions, out.key, "model's outputs")
            flags = np.asarray(losses.looks_like_probabilities(outputs))
            if flags.size and flags.all():
                name = repr(out.loss_name) + (f" (output {out.name!r})" if out.name else "")
                found.append((name, losses.reading_probabilities(out.loss, outputs)))
        return found


def _pick_output(key: OutputKey, predictions: PyTree, targets: PyTree) -> tuple[PyTree, PyTree]:
    """One output's predictions and targets from the whole structures."""
    return _pick(predictions, key, "model's outputs"), None if targets is None else _pick(targets, key, "targets")


class _OnOutput:
    """A metric of one output, called on the whole structures."""

    def __init__(self, fn: MetricFn, pick: Picker):
        self.fn, self.pick = fn, pick
        self.__name__ = getattr(fn, "__name__", "metric")  # a user's callable

    def __call__(self, predictions, targets):
        return self.fn(*self.pick(predictions, targets))


class _StatefulOnOutput(BatchMetric):
    """A stateful metric of one output: it keeps its state, on this output."""

    def __init__(self, metric: BatchMetric, pick: Picker):
        self.metric, self.pick = metric, pick
        self.__name__ = getattr(metric, "__name__", "metric")  # a user's metric

    def batch_state(self, predictions, targets, *, mask, weights):
        return self.metric.batch_state(*self.pick(predictions, targets), mask=mask, weights=weights)
