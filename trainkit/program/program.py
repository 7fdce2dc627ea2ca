"""``Program``: what one training setup computes, with no state and no devices: the initial
``TrainState``, the pure train / eval / predict steps compiled under a given strategy, and the
compiled plan of a batch under candidate strategies.

>>> import jax, numpy as np, optax, flax.linen as nn
>>> from trainkit.core import model
>>> from trainkit.objective import losses
>>> from trainkit.objective import Objective
>>> from trainkit.core.precision import get_precision
>>> from trainkit.strategies import SingleDevice
>>> adapter = model.adapt_model(nn.Dense(2))
>>> def compute_loss(params, batch, rng, *, model_state, train):
...     out, model_state = adapter.apply(params, model_state, batch["x"], rng=rng, train=train)
...     return losses.mean_squared_error(out, batch["y"]), (out, model_state)
>>> program = Program(adapter=adapter, compute_loss=compute_loss, apply=adapter.apply, optimizer=optax.sgd(0.1),
...                   objective=Objective("mse"), precision=get_precision("fp32"))
>>> state = program.create_state(SingleDevice(), np.ones((1, 3), np.float32))
>>> int(state.step), state.params["kernel"].shape
(0, (3, 2))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np
import optax

from trainkit.attn.kernels import Platform
from trainkit.core import cost, tree
from trainkit.core import lora as lora_lib
from trainkit.core.lora import LoRA, is_adapter
from trainkit.core.model import AxisNames, LinenModel, ModelAdapter, param_axes, starting_variables, with_lora
from trainkit.core.offload import Offload
from trainkit.core.optimizer_groups import OptimizerGroups
from trainkit.core.precision import Precision, cast_floating
from trainkit.core.remat import Remat, rematerialised, repeated_blocks, wrap_remat
from trainkit.core.spikes import SpikeSkip
from trainkit.core.state import Batch, TrainState, seed_key
from trainkit.core.statistics import StepStatistics
from trainkit.core.step import (
    TOTALS_UNPACKED_ON,
    LossFn,
    make_gathered_steps,
    make_multi_step,
    make_predict_step,
    with_totals,
)
from trainkit.core.step_value import Step
from trainkit.core.totals import EpochTotals, pack
from trainkit.core.trace_context import traced_under
from trainkit.core.trainable import Trainable, TrainableSpec
from trainkit.core.tree import Apply, PyTree, TreeFunction
from trainkit.core.warn import warn_user
from trainkit.objective import Objective
from trainkit.planning import plan as plan_lib
from trainkit.program.own_step import OwnStep
from trainkit.program.steps import Steps
from trainkit.strategies import Strategy
from trainkit.strategies.pipeline import NotPipelined, stacked_parameters, staged


class Program:
    """The pure functions of a setup (see the module docstring).

    Args:
        adapter: the model as ``(init, apply)``.
        compute_loss: ``(params, batch, rng, *, model_state, train) -> (row_loss, (outputs,
            model_state))``.
        apply: the model call ``compute_loss`` and the predict step use (a trainer's
            ``apply``; default: :attr:`run_model`).
        remat: the rematerialisation setting (``trainkit.core.remat``); :attr:`run_model` is the
            adapter's call under it and the precision policy.
        optimizer, precision, grad_accum_steps, log_grad_norm, seed: as the
            :class:`trainkit.Trainer` arguments.
        objective: a :class:`trainkit.objective.Objective`; its ``metric_fns`` are read when a
            step is compiled.
        variables: variables to start from (fine-tuning), or ``None``.
        trainable: which parameters train (:mod:`trainkit.core.trainable`); ``None``: all.
        lora: a :class:`~trainkit.core.lora.LoRA`: adapters on the adapter's linen module, which
            alone train (with ``trainable``'s parameters); the base frozen.
        eager: no compilation: :meth:`compile` returns the pure step (Keras's ``run_eagerly``).
        spike_skip: a :class:`~trainkit.core.spikes.SpikeSkip`: spiking updates are not applied.
        frozen_statistics: a ``BatchNorm`` whose parameters are all frozen runs in inference mode
            in training (:mod:`trainkit.core.frozen_statistics`); ``False``: its statistics train.
        offload: what lives in host memory (:class:`~trainkit.core.offload.Offload`): the strategy
            places it there and the train step streams it through the update.
        step: the user's own step value (:class:`~trainkit.core.step_value.Step`: ``Trainer(step=...)``
            or the adapter of a ``train_step`` / ``test_step`` override), whose ``train`` replaces
            the built-in loss, gradient and update, and ``test`` the evaluation (``None``: the built-in ones).
    """

    def __init__(
        self,
        *,
        adapter: ModelAdapter,
        compute_loss: LossFn,
        apply: Apply | None = None,
        remat: Remat = None,
        optimizer: optax.GradientTransformation | dict[str, optax.GradientTransformation],
        objective: Objective,
        precision: Precision,
        grad_accum_steps: int = 1,
        log_grad_norm: bool = False,
        seed: int = 0,
        variables: PyTree = None,
        eager: bool = False,
        trainable: TrainableSpec = None,
        lora: LoRA | None = None,
        spike_skip: SpikeSkip | None = None,
        frozen_statistics: bool = True,
        offload: Offload = Offload(),  # noqa: B008 - a frozen value
        step: Step | None = None,
    ):
        self.spike_skip, self.offload = _checked_spike_skip(spike_skip), offload
        #: why this trainer's settings cannot offload the optimizer's state (``None``: they can)
        self.offload_refusal = offload_refusal(eager=eager, precision=precision, spike_skip=spike_skip)
        if offload and self.offload_refusal is not None:
            raise ValueError(self.offload_refusal)
        self.lora, self.base_adapter = lora, adapter  # the model without adapters: what merge_lora and export give
        adapter = adapter if lora is None else with_lora(adapter, lora, seed)
        self.run_model, self.remat = staged(precision.wrap_apply(wrap_remat(adapter, remat))), remat
        self.adapter, self.compute_loss, self.apply = adapter, compute_loss, apply or self.run_model
        adapters = "" if lora is None else f"lora=tk.LoRA(targets={lora.targets!r}) matches no module (no adapter made)"
        self.trainable = Trainable.of(trainable, extra=None if lora is None else is_adapter, extra_name=adapters)
        #: the optimizer's groups, when it is a dict of optimizers by parameter path
        self.groups, self.optimizer = _optimizer(optimizer, self.trainable)
        if offload.frozen and not self.trainable.freezes:
            raise ValueError(OFFLOAD_NOTHING_FROZEN)
        self.objective, self.precision = objective, precision
        self.grad_accum_steps, self.seed, self.variables, self.eager = grad_accum_steps, seed, variables, eager
        self._settings_checked = False  # idle_settings warned about (at the first trace of the state)
        #: the steps' values and facts (:mod:`trainkit.program.steps`)
        self.steps = Steps(
            own=OwnStep(step, evaluates_alone=objective.spec[0] is None and not objective.own_loss),
            objective=objective,
            adapter=adapter,
            run_model=self.run_model,
            compute_loss=compute_loss,
            trainable=self.trainable,
            optimizer=self.optimizer,
            groups=self.groups,
            grad_accum_steps=grad_accum_steps,
            offload=offload,
            spike_skip=self.spike_skip,
            log_grad_norm=log_grad_norm,
            frozen_statistics=frozen_statistics,
            precision=precision,
        )
        self._param_axes: dict[str, AxisNames] | None = None  # the model's partitioning annotations, once read
        self._abstract_states: dict[str, PyTree] = {}  # abstract_state by the first row's signature

    # ------------------------------------------------------------------ the initial state
    def init_state(self, variables: PyTree, first_row: PyTree, key: jax.Array) -> TrainState:
        """The state at step 0 from the seed's ``key`` (``seed_key(seed)``), an argument rather
        than a constant, so one compiled init serves every seed (pure: run it under ``jit`` or
        ``eval_shape``)."""
        init_rng, state_rng = jax.random.split(key)
        params, model_state = self.adapter.init(init_rng, first_row) if variables is None else variables
        params = cast_floating(params, self.precision.param_dtype)
        self.trainable.check(params)
        if not self._settings_checked:  # once per trainer (the state is traced more than once)
            self._settings_checked = True
            for note in idle_settings(self.lora, params):
                warn_user(note)
        spikes = None if self.spike_skip is None else self.spike_skip.initial()
        return TrainState.create(
            params=params, opt_state=self.optimizer.init(params), model_state=model_state, seed=state_rng
        ).replace(loss_scale=self.precision.init_loss_scale(), spikes=spikes)

    def create_state(self, strategy: Strategy, first_row: PyTree) -> TrainState:
        """The state built directly in ``strategy``'s shardings (a configured strategy: see
        :meth:`configured`)."""
        state: TrainState = strategy.create_state(
            self.init_state, starting_variables(self.adapter, self.variables, first_row), first_row, seed_key(self.seed)
        )
        return state

    def configured(self, strategy: Strategy, first_row: PyTree) -> Strategy:
        """``strategy`` configured before it places anything: with the model's parameter
        annotations when it maps logical axis names (``rules=[("embed", "fsdp"), ...]``), and
        with the offload; else itself. A strategy that cannot offload is returned as it is (a
        plan's candidate is then refused by :meth:`candidate_step`; a chosen one by the setup)."""
        if strategy.logical_rules:
            if self._param_axes is None:
                self._param_axes = param_axes(self.adapter, first_row)
            strategy = strategy.with_annotations(self._param_axes)
        if strategy.stage_axis is not None:
            state = self.abstract_state(first_row)
            stages = strategy.mesh.shape[strategy.stage_axis]
            strategy = strategy.with_stages(
                stacked_parameters(self.run_model, state.params, state.model_state, first_row, stages)
            )
        if not strategy.offloads:
            return strategy
        if not self.offload.frozen:
            return strategy.with_offload(self.offload)
        params = self.abstract_state(first_row).params
        return strategy.with_offload(self.offload.keeping(self.trainable.frozen_paths(params)))

    def configured_candidates(
        self, candidates: Sequence[Strategy], first_row: PyTree
    ) -> tuple[list[Strategy], dict[int, str]]:
        """A plan's candidates :meth:`configured`, and why each one that cannot run this model is
        left out (by ``id``: a pipeline on a model without stacked blocks is a row, not a crash)."""
        configured, refused = [], {}
        for strategy in candidates:
            try:
                configured.append(self.configured(strategy, first_row))
            except NotPipelined as error:
                configured.append(strategy)
                refused[id(strategy)] = f"cannot pipeline this model: {error}"
        return configured, refused

    def repeated_blocks(self, first_row: PyTree) -> list[str]:
        """The class names of the model's repeated blocks (:func:`trainkit.core.remat.repeated_blocks`),
        what a plan rematerialises when nothing fits; empty for an NNX model (remat needs linen)
        or one without repeated submodules."""
        if not isinstance(self.adapter, LinenModel):
            return []
        state = self.abstract_state(first_row)
        calls = self.adapter.module_calls(state.params, state.model_state, first_row)
        return repeated_blocks([(call.path, call.kind) for call in calls])

    def changes_result(self, strategy: Strategy, first_row: PyTree, state: PyTree = None) -> str | None:
        """Why ``strategy`` would train this model on other numbers than ``SingleDevice`` does
        (``None``: it would not): under a named device axis (``jax.pmap``), BatchNorm layers that
        do not reduce over it normalise each device's rows by their own statistics. ``state``:
        the abstract state, when the caller has it."""
        axis = strategy.axis_name
        if axis is None:
            return None
        state = self.abstract_state(first_row) if state is None else state
        layers = self.adapter.batch_statistics_layers(state.params, state.model_state, first_row, axis)
        frozen = self.steps.frozen_layers(state.params, state.model_state, first_row)  # they compute no statistics
        layers = [layer for layer in layers if layer.split(" (")[0] not in frozen]
        if not layers:
            return None
        verb = "normalise" if len(layers) > 1 else "normalises"
        return (
            f"{', '.join(layers)} {verb} each device's rows by their own batch statistics under "
            f"{type(strategy).__name__} (pmap), not the whole batch's as on one device; for global statistics "
            f"build them with axis_name={axis!r} (nn.BatchNorm(..., axis_name={axis!r}))"
        )

    def candidate_step(
        self,
        kind: str,
        strategy: Strategy,
        abstract_state: PyTree,
        first_row: PyTree,
        statistics: StepStatistics | None = None,
    ) -> TreeFunction:
        """``compile(kind, ...)`` for a plan's candidate; :class:`~trainkit.planning.plan.NotACandidate`
        for a candidate whose training step would compute another result than ``SingleDevice``'s."""
        reason = self.changes_result(strategy, first_row, abstract_state) if kind == "train" else None
        if self.offload and not strategy.offloads:
            reason = strategy.no_offload()
        if reason is not None:
            raise plan_lib.NotACandidate(reason)
        return self.compile(kind, strategy, abstract_state, statistics)

    def step_flops(self, abstract_state: PyTree, host_batch: Batch) -> float | None:
        """The floating-point operations of one train step on ``host_batch`` (a padded global
        batch), from the lowered step's cost analysis (traced, not compiled: no strategy needed);
        ``None`` when the backend reports none."""
        totals = pack(self.empty_totals("train", abstract_state, host_batch))
        return cost.flops(jax.jit(self.step("train", None)).lower(abstract_state, totals, host_batch))

    # ------------------------------------------------------------------ compiled steps
    def compile(
        self, kind: str, strategy: Strategy, abstract_state: PyTree, statistics: StepStatistics | None = None
    ) -> TreeFunction:
        """The ``"train"``, ``"train_measured"`` (the train step that measures the statistics,
        called on their due steps), ``"train_steps"`` (several steps over stacked batches),
        ``"eval"`` or ``"predict"`` step compiled by ``strategy`` (with ``eager``: the pure step
        itself, run op by op on one device); a strategy compiles both train steps as ``"train"``.
        ``statistics``: what the training steps measure (a ``fit``'s ``GradientStats``)."""
        if self.eager:
            return self.step(kind, None, statistics)
        platform = strategy.devices[0].platform
        step = self.step(kind, strategy.axis_name, statistics, offload=bool(strategy.offload), platform=platform)
        if kind not in ("eval", "predict"):  # remat a plan added (strategy="auto" when nothing fits)
            step = rematerialised(step, strategy.remat)
        step = traced_under(step, Platform(platform), *strategy.trace_parts())  # the step's context, handed once
        return strategy.compile("train" if kind == "train_measured" else kind, step, abstract_state)

    def step(
        self,
        kind: str,
        axis: str | None,
        statistics: StepStatistics | None = None,
        *,
        offload: bool | None = None,
        platform: str = "cpu",
    ) -> TreeFunction:
        """The pure step a strategy compiles (not compiled): ``"train"`` ``(state, totals,
        batch) -> (state, totals)`` (with statistics, ``"train_measured"`` measures them and
        ``"train"`` does not), ``"train_steps"`` the same over stacked batches (measuring on
        the due steps), ``"eval"``
        ``(state, totals, batch) -> totals`` (``totals``: the epoch's
        :class:`~trainkit.core.totals.EpochTotals`), ``"predict"`` ``(state, batch) -> outputs``.
        ``offload``: the optimizer's state is in host memory (``None``: as the trainer says); ``platform``: the
        devices' it is compiled for, which decides how a fused call carries the epoch's totals
        (:data:`~trainkit.core.step.TOTALS_UNPACKED_ON`)."""
        if kind in ("train_steps", "train_steps_gathered"):
            steps = make_multi_step(
                with_totals(self.steps.metrics_step("train", axis, "due", statistics, offload=offload)),
                unrolled=self.eager,
                unpack_totals=platform in TOTALS_UNPACKED_ON,
            )
            return steps if kind == "train_steps" else make_gathered_steps(steps)
        if kind == "predict":
            return make_predict_step(self.apply)
        when = "always" if kind == "train_measured" else "never"
        return with_totals(
            self.steps.metrics_step(kind, axis, when, statistics, offload=offload), trains=kind != "eval"
        )

    def outputs(self, state: TrainState, x: PyTree) -> PyTree:
        """The model's outputs for inputs ``x`` in inference mode, as the predict step computes
        them (pure: trace it with ``jax.eval_shape`` or compile it with ``jax.jit``)."""
        return make_predict_step(self.apply)(state, {"x": x})

    def exported_outputs(self, float32: bool = False) -> Callable[[TrainState, PyTree], PyTree]:
        """What an export computes: :meth:`outputs`, of the model without adapters under LoRA (on a
        state holding :meth:`merged_params`'s), and with ``float32`` in float32 whatever the
        precision policy (the model's own call then: a trainer's ``apply`` override is not in it)."""
        if self.lora is None and not float32:
            return self.outputs
        adapter = self.adapter if self.lora is None else self.base_adapter
        step = make_predict_step((Precision() if float32 else self.precision).wrap_apply(adapter.apply))
        return lambda state, x: step(state, {"x": x})

    def merged_params(self, params: PyTree) -> PyTree:
        """LoRA's adapters folded into their kernels (the parameters of the model without them)."""
        return params if self.lora is None else self.lora.merged(params)

    def empty_totals(
        self,
        kind: str,
        abstract_state: PyTree,
        host_batch: Batch,
        axis: str | None = None,
        statistics: StepStatistics | None = None,
    ) -> EpochTotals:
        """Host zeros of the totals the ``kind`` step (``"train"``, ``"train_steps"`` or
        ``"eval"``) carries, shaped by tracing its metrics on one host batch; under a named
        device ``axis`` (which the model may use too: ``BatchNorm(axis_name=...)``) traced as
        one device of it."""
        kind = "eval" if kind == "eval" else "train"
        step = self.steps.metrics_step(kind, axis, statistics=statistics)
        if axis is not None:
            one = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *np.shape(a)), a.dtype), host_batch)
            outputs = jax.eval_shape(jax.vmap(step, in_axes=(None, 0), axis_name=axis), abstract_state, one)
            outputs = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), outputs)
        else:
            outputs = jax.eval_shape(step, abstract_state, host_batch)
        return EpochTotals.empty(outputs if kind == "eval" else outputs[1])

    def abstract_state(self, first_row: PyTree, variables: PyTree = None) -> PyTree:
        """The shapes and dtypes of the state at step 0 (traced, nothing computed), from
        ``variables`` when they were already resolved; traced once per input signature (the
        first batch is traced for its outputs, "auto"'s remembered decision and the plan)."""
        if variables is not None:
            return jax.eval_shape(self.init_state, variables, first_row, seed_key(self.seed))
        key = repr((jax.tree.structure(first_row), tree.signature(first_row)))
        if key not in self._abstract_states:
            variables = starting_variables(self.adapter, self.variables, first_row)
            self._abstract_states[key] = jax.eval_shape(self.init_state, variables, first_row, seed_key(self.seed))
        return self._abstract_states[key]

    def plan(
        self,
        host_batch: Batch,
        candidates: Sequence[Strategy] | None,
        *,
        trains: bool,
        statistics: StepStatistics | None = None,
        settings: plan_lib.PlanSettings = plan_lib.PlanSettings(),  # noqa: B008 - a frozen value
    ) -> plan_lib.MemoryPlan:
        """:func:`trainkit.planning.plan.plan_step` of the train step (or, when ``trains`` is false, the
        predict step) on a padded global batch."""
        kind = "train" if trains else "predict"
        first_row = host_batch["x"]  # the model is initialised on a real batch, as it trains
        variables = starting_variables(self.adapter, self.variables, first_row)
        if candidates is None:
            sequences = [np.shape(leaf)[1] for leaf in jax.tree.leaves(first_row) if np.ndim(leaf) >= 2]
            context = plan_lib.context_candidate(np.shape(host_batch["mask"])[0], next(iter(sequences), None))
            candidates = plan_lib.default_candidates() + ([context] if context is not None else [])
        candidates, refused = self.configured_candidates(candidates, first_row)
        abstract_state = self.abstract_state(first_row, variables)
        init_state, key = self.init_state, seed_key(self.seed)
        # traced as one device of a named axis when a candidate has one (a BatchNorm may reduce over it)
        axis = next((strategy.axis_name for strategy in candidates if strategy.axis_name is not None), None)
        plan = plan_lib.plan_step(
            host_batch,
            candidates,
            abstract_state=abstract_state,
            totals=pack(self.empty_totals(kind, abstract_state, host_batch, axis, statistics)) if trains else None,
            compile_step=lambda strategy, abstract: self.candidate_step(
                kind, strategy, abstract, first_row, statistics
            ),
            # one init_fn object for both, so that the second finds the first's executable
            create_state=lambda strategy: strategy.create_state(init_state, variables, first_row, key),
            precompile_state=lambda strategy: strategy.precompile_state(init_state, variables, first_row, key),
            micro_batches=self.grad_accum_steps if trains else 1,
            trains=trains,
            settings=settings,
            refused=refused,
        )
        parts = self.trainable.state_bytes(abstract_state)
        if self.groups is not None:  # and each group's share of the optimizer's state
            inner = {name: self.groups.inner_state(abstract_state.opt_state, name) for name in self.groups.names}
            parts.update({f"optimizer state ({name})": tree.tree_bytes(state) for name, state in inner.items()})
        return dataclasses.replace(plan, state_bytes=parts)


OFFLOAD_NOTHING_FROZEN = (
    "offload='optimizer+frozen' keeps the frozen parameters in host memory, but none is frozen: pass "
    "lora=tk.LoRA(...) or trainable=... (the others frozen), or offload='optimizer'."
)


def _checked_spike_skip(spike_skip: object) -> SpikeSkip | None:
    """``skip_spikes=`` as given, refused unless a ``tk.SpikeSkip`` (or ``None``)."""
    if spike_skip is not None and not isinstance(spike_skip, SpikeSkip):
        raise TypeError(
            f"skip_spikes takes a tk.SpikeSkip; received {spike_skip!r}. Pass skip_spikes=tk.SpikeSkip() (the "
            "defaults) or tk.SpikeSkip(factor=..., warmup=...)."
        )
    return spike_skip


def _optimizer(
    optimizer: optax.GradientTransformation | dict[str, optax.GradientTransformation], trainable: Trainable
) -> tuple[OptimizerGroups | None, optax.GradientTransformation]:
    """The optimizer's groups (a dict of optimizers by parameter path; else ``None``) and the one
    transformation the step applies: the groups' ``multi_transform`` with the frozen leaves, or the
    optimizer with ``set_to_zero`` (no state) for the frozen leaves."""
    if isinstance(optimizer, dict):
        groups = OptimizerGroups(optimizer)
        return groups, groups.transform(trainable.trains)
    return None, trainable.optimizer(optimizer)


def offload_refusal(*, eager: bool, precision: Precision, spike_skip: SpikeSkip | None) -> str | None:
    """Why these settings cannot keep the optimizer's state in host memory (``None``: they
    can). Each would read the optimizer's whole state on the device after the update (to
    keep the old one), or compiles nothing."""
    if eager:
        return (
            "offload='optimizer' moves the optimizer's state between host and device memory inside the compiled "
            "step, and run_eagerly=True compiles nothing. Debug with offload=None, then train with offload."
        )
    if precision.loss_scale is not None:
        return (
            f"offload='optimizer' with loss scaling ({precision.loss_scale!r}) is not supported: a step the scale "
            "skips would keep the whole old optimizer state on the device. Use precision='bf16' (no loss scale) "
            "or offload=None."
        )
    if spike_skip is not None:
        return (
            "offload='optimizer' with skip_spikes is not supported: a skipped step would keep the whole old "
            "optimizer state on the device. Pass one of the two."
        )
    return None


def idle_settings(lora: LoRA | None, params: PyTree) -> list[str]:
    """What would train nothing or do nothing on these parameters, one line each (warned once
    per trainer, at the first trace of its state)."""
    notes = [] if lora is None else lora_lib.idle_settings(lora, params)
    if not jax.tree.leaves(params):
        notes.append(
            "The model has no parameters, so fit trains nothing (every update and gradient statistic is 0). A "
            "linen module creates its layers in setup() or an @nn.compact __call__; an NNX module in __init__."
        )
    return notes
