"""The steps of one setup, as values: :class:`Steps` holds what a step is made from (the model's
call under the precision policy and remat, ``compute_loss``, the objective, the optimizer and its
groups, the trainable leaves, the built-in step's features, the user's own step) and gives, for
each kind, the :class:`~trainkit.core.step_value.Step` value it is compiled from (the built-in
:class:`~trainkit.core.loss_step.LossStep` or the user's), the facts its helpers read, and the
step before its metrics are merged into the totals. :class:`~trainkit.program.program.Program`
holds one and compiles what it gives.

>>> import jax, numpy as np, optax, flax.linen as nn
>>> from trainkit.core import model
>>> from trainkit.core.loss_step import LossStep
>>> from trainkit.core.trainable import Trainable
>>> from trainkit.objective import Objective, losses
>>> adapter = model.adapt_model(nn.Dense(2))
>>> def compute_loss(params, batch, rng, *, model_state, train):
...     out, model_state = adapter.apply(params, model_state, batch["x"], rng=rng, train=train)
...     return losses.mean_squared_error(out, batch["y"]), (out, model_state)
>>> steps = Steps(own=OwnStep(None, evaluates_alone=False), objective=Objective("mse"), adapter=adapter,
...               run_model=adapter.apply, compute_loss=compute_loss, trainable=Trainable(None),
...               optimizer=optax.sgd(0.1))
>>> isinstance(steps.step_value("train"), LossStep), steps.step_facts("data").axis_name
(True, 'data')
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import optax

from trainkit.core import custom_step as custom_lib
from trainkit.core import frozen_statistics as frozen_lib
from trainkit.core import loss_call
from trainkit.core.features.grad_norm import global_grad_norm
from trainkit.core.features.gradient_statistics import measure_statistics
from trainkit.core.features.label_check import check_labels
from trainkit.core.features.spike_skipping import skip_spikes
from trainkit.core.loss_step import LossStep
from trainkit.core.model import ModelAdapter, bind_inputs
from trainkit.core.offload import Offload
from trainkit.core.optimizer_groups import OptimizerGroups
from trainkit.core.precision import Precision
from trainkit.core.spikes import SpikeSkip
from trainkit.core.state import Batch
from trainkit.core.statistics import StepStatistics
from trainkit.core.step import LossFn, TrainStepOptions
from trainkit.core.step_feature import StepFeature
from trainkit.core.step_state import StepFacts
from trainkit.core.step_value import Step
from trainkit.core.trainable import Trainable
from trainkit.core.tree import Apply, PyTree, TreeFunction
from trainkit.objective import Objective
from trainkit.program.own_step import OwnStep


class Steps:
    """What the steps of one setup are made from (``Program``'s arguments of the same names, the
    model already wrapped: ``run_model`` is its call under the precision policy and remat), and
    the steps made from it. ``frozen_statistics``: a ``BatchNorm`` whose parameters are all frozen
    runs in inference mode in training."""

    def __init__(
        self,
        *,
        own: OwnStep,
        objective: Objective,
        adapter: ModelAdapter,
        run_model: Apply,
        compute_loss: LossFn,
        trainable: Trainable,
        optimizer: optax.GradientTransformation,
        groups: OptimizerGroups | None = None,
        grad_accum_steps: int = 1,
        offload: Offload = Offload(),  # noqa: B008 - a frozen value
        spike_skip: SpikeSkip | None = None,
        log_grad_norm: bool = False,
        frozen_statistics: bool = True,
        precision: Precision = Precision(),  # noqa: B008 - a frozen value
    ) -> None:
        if own.trains:
            refuse_for_own_step(grad_accum_steps, precision, spike_skip, log_grad_norm, offload)
        #: the user's own step (``own.value``; ``None``: the built-in one)
        self.own, self.objective, self.adapter, self.run_model = own, objective, adapter, run_model
        self.compute_loss, self.trainable, self.optimizer, self.groups = compute_loss, trainable, optimizer, groups
        self.grad_accum_steps, self.offload, self.spike_skip = grad_accum_steps, offload, spike_skip
        self.log_grad_norm, self.frozen_statistics = log_grad_norm, bool(frozen_statistics)
        self.log_names: tuple[str, ...] | None = None  # compute_loss's own logs, in their order (found when traced)
        self._frozen_layers: frozenset[str] | None = None  # the frozen BatchNorms, found at the first trace

    def frozen_layers(self, params: PyTree, model_state: PyTree, x: PyTree) -> frozenset[str]:
        """The ``BatchNorm`` layers whose parameters are all frozen, which train in inference mode
        (empty with ``frozen_statistics=False`` or nothing frozen); found once (traced)."""
        if self._frozen_layers is None:
            found: frozenset[str] = frozenset()
            if self.frozen_statistics and self.trainable.freezes:
                calls = self.adapter.module_calls(params, model_state, x)
                paths = ["/".join(map(str, call.path)) for call in calls if call.kind == "BatchNorm"]
                order = ["/".join(map(str, call.path)) for call in calls]
                found = frozen_lib.frozen_layers(paths, params, self.trainable.trains, order)
            self._frozen_layers = found
        return self._frozen_layers

    def training_loss(self, params: PyTree, batch: Batch, rng: jax.Array, *, model_state: PyTree, train: bool):
        """``compute_loss`` with the frozen ``BatchNorm`` layers in inference mode when it trains."""
        layers = self.frozen_layers(params, model_state, batch["x"]) if train else frozenset()
        calls = self.objective.loss_calls
        with frozen_lib.statistics_frozen(layers), loss_call.tracing(train, model_state) as call:
            result = self.compute_loss(params, batch, rng, model_state=model_state, train=train)
        self.objective.check_used(calls)
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], tuple) and len(result[1]) >= 2:
            loss_call.check_returned(call, result[1][1])  # any other structure: loss_parts names the contract
        self._record_logs(result[1][2] if _has_logs(result) else {})
        return result

    def call_model(
        self, params: PyTree, model_state: PyTree, x: PyTree, *, rng: jax.Array, train: bool, method: str | None = None
    ) -> tuple[PyTree, PyTree]:
        """:attr:`run_model` of ``__call__`` or the module's ``method``."""
        options = {} if method is None else {"method": method}
        out = self.run_model(params, model_state, x, rng=rng, train=train, **options)
        loss_call.applied(train, model_state, out[1])  # inside a traced compute_loss: its mistakes
        return out

    def _record_logs(self, logs: PyTree) -> None:
        if self.log_names is None and isinstance(logs, dict):
            self.log_names = tuple(logs)

    @property
    def log_order(self) -> tuple[str, ...]:
        """The names the logs hold, in order: the objective's (the loss, its terms, the metrics)
        and ``compute_loss``'s logs, or the user's ``train_step``'s logs alone (once traced)."""
        if self.own.trains:
            return self.own.log_names or ()
        logs = self.log_names or ()
        order = self.objective.log_order
        return (order[0], *logs, *order[1:])

    def step_facts(self, axis: str | None, *, inference: bool = False) -> StepFacts:
        """What a custom step's state helpers read under the device ``axis``; ``inference``: the
        model always called in inference mode (no dropout: the audit's comparison of device splits)."""
        bind = functools.partial(bind_inputs, self.adapter.module)
        call = functools.partial(_in_inference, self.call_model) if inference else self.call_model
        return StepFacts(axis, self.optimizer, self.groups, self.trainable, call, bind)

    def audited_train_step(
        self, zero_gradients: list[tuple[str, bool]] | None, axis: str | None = None, *, inference: bool = False
    ) -> TreeFunction:
        """The user's ``train_step`` under ``jit`` semantics (``axis``: under a device axis, as a
        ``vmap`` over devices runs it), appending to ``zero_gradients`` as it runs whether each
        update's gradients were all zero; ``inference``: the model in inference mode
        (:mod:`trainkit.program.step_audit`)."""
        assert self.own.trains
        facts = self.step_facts(axis, inference=inference)  # the value that trains, traced as it is
        return custom_lib.make_custom_train_step(self.own.traced.train, facts, zero_gradients)

    def metrics_step(
        self,
        kind: str,
        axis: str | None,
        statistics_when: str = "due",
        statistics: StepStatistics | None = None,
        *,
        offload: bool | None = None,
    ) -> TreeFunction:
        """The ``"train"`` step ``(state, batch) -> (state, metrics)`` or the ``"eval"`` step
        ``(state, batch) -> metrics``, before their metrics are merged into the totals; the
        statistics (``GradientStats``) measured as ``statistics_when`` says
        (:meth:`~trainkit.core.statistics.StepStatistics.metrics`)."""
        value, facts = self.step_value(kind, statistics, statistics_when, offload), self.step_facts(axis)
        return value.test_metrics(facts) if kind == "eval" else value.train_metrics(facts)

    def step_value(
        self, kind: str, statistics: StepStatistics | None = None, when: str = "due", offload: bool | None = None
    ) -> Step:
        """The step value the ``"train"`` or ``"eval"`` step is compiled from: the user's own
        (``step=``, an override) where it replaces that kind, else the built-in
        :class:`~trainkit.core.loss_step.LossStep` with this trainer's settings, the statistics
        measured as ``when`` says and ``offload`` (``None``: as the trainer says)."""
        if self.own.tests if kind == "eval" else self.own.trains:
            if kind != "eval":
                self._refuse_for_own_train_step(statistics)
            return self.own.traced
        options = TrainStepOptions(
            self.grad_accum_steps,
            self.trainable,
            self.step_features(statistics, when) if kind != "eval" else (),
            bool(self.offload) if offload is None else offload,
            groups=self.groups,
            valid_tokens=self.objective.valid_tokens(),
        )
        return LossStep(self.training_loss, self.objective.metric_fns, options)

    def _refuse_for_own_train_step(self, statistics: StepStatistics | None) -> None:
        """What the built-in step alone can do, refused for the user's own ``train_step``: its loss,
        gradients and update are its own, so the built-in step's features are not in it."""
        if self.objective.valid_tokens() is not None:
            raise ValueError(
                "The loss ignores a class (ignore_class), and this trainer's train_step is its own: trainkit would not "
                "see which tokens it reduces over. Weigh the tokens in train_step yourself (a mask of the targets that "
                "are not that class) and drop ignore_class, or use the built-in step."
            )
        if statistics is not None:
            raise ValueError(
                "GradientStats measures the built-in step's gradients, and this trainer's train_step is its own (its "
                "gradients are its locals). Log what you need from train_step's logs, or drop GradientStats."
            )

    def step_features(self, statistics: StepStatistics | None, when: str = "due") -> tuple[StepFeature, ...]:
        """The train step's features (:mod:`trainkit.core.features`) this trainer's settings
        ask for, in the order they run: spike skipping, the global gradient norm, the
        statistics a fit measures (as ``when`` says), the label check. The one place a feature
        is registered."""
        features: list[StepFeature] = []
        if self.spike_skip is not None:  # first: the others see the update it keeps
            features.append(jax.named_call(skip_spikes(self.spike_skip), name="skip_spikes"))
        if self.log_grad_norm:
            features.append(jax.named_call(global_grad_norm, name="grad_norm"))
        if statistics is not None:
            features.append(jax.named_call(measure_statistics(statistics, when), name="gradient_statistics"))
        features.append(jax.named_call(check_labels(self.objective.labels_out_of_range), name="label_check"))
        return tuple(features)


def _has_logs(result: PyTree) -> bool:
    return isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], tuple) and len(result[1]) == 3


def _in_inference(
    call: Callable[..., tuple[PyTree, PyTree]], *args: PyTree, train: bool, **options: PyTree
) -> tuple[PyTree, PyTree]:
    """``call`` (the model's) in inference mode whatever ``train`` says."""
    return call(*args, train=False, **options)


def refuse_for_own_step(
    grad_accum_steps: int, precision: Precision, spike_skip: SpikeSkip | None, log_grad_norm: bool, offload: Offload
) -> None:
    """Raises a ``ValueError`` saying why a trainer with a ``train_step`` of its own cannot have
    these settings (nothing where it can): each works on the built-in step's one loss, gradient
    and update, which a custom step computes itself (it may differentiate several losses and
    update several groups)."""
    why = "the step's loss, gradients and updates are its own, so trainkit has no one loss or update to"
    mine = "with a train_step of your own"
    if grad_accum_steps != 1:
        raise ValueError(
            f"grad_accum_steps={grad_accum_steps} {mine}: {why} accumulate. Pass grad_accum_steps=1 (a larger "
            "batch, or accumulate inside train_step)."
        )
    if precision.loss_scale is not None:
        raise ValueError(
            f"precision={precision!r} scales the loss (fp16) and skips non-finite steps, but {mine} {why} scale. "
            "Use precision='bf16' (no loss scale) or 'fp32'."
        )
    if spike_skip is not None:
        raise ValueError(f"skip_spikes {mine}: {why} judge. Drop skip_spikes, or skip inside train_step.")
    if log_grad_norm:
        raise ValueError(
            f"log_grad_norm=True {mine}: {why} measure. Log optax.global_norm(grads) from train_step instead."
        )
    if offload:
        raise ValueError(
            f"offload={offload!r} streams the built-in update, and {mine} {why} stream. Pass offload=None."
        )
