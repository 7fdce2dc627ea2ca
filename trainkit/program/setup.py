"""``Setup``: a trainer's parts before its first step, composed: what it decided
(:class:`~trainkit.program.decisions.Decided`, one frozen value replaced whole), the live
state's reads and edits (:class:`~trainkit.program.state_access.StateAccess`), the compiled
steps the loop runs (:class:`~trainkit.program.compiled.CompiledFunctions`, the loop's
``CompiledSteps``). The setup itself applies ``"auto"``'s choice
(:func:`trainkit.program.auto.choose`), creates the state from the first batch, traces the
model's outputs once and builds the objective; :mod:`trainkit.program.inputs` resolves and
checks the input through it. The live ``TrainState`` is the trainer's
:class:`~trainkit.record.session.Session`'s, replaced through the session's methods.

>>> import numpy as np, optax, flax.linen as nn
>>> from trainkit.core.model import adapt_model
>>> from trainkit.core.precision import get_precision
>>> from trainkit.objective import Objective
>>> from trainkit.program.program import Program
>>> adapter, objective = adapt_model(nn.Dense(2)), Objective("mse")
>>> def compute_loss(params, batch, rng, *, model_state, train):
...     out, model_state = adapter.apply(params, model_state, batch["x"], rng=rng, train=train)
...     return objective.loss(out, batch["y"]), (out, model_state)
>>> program = Program(adapter=adapter, compute_loss=compute_loss, apply=adapter.apply, optimizer=optax.sgd(0.1),
...                   objective=objective, precision=get_precision("fp32"))
>>> from trainkit.record.session import Session
>>> session = Session()
>>> setup = Setup(program, "single", session=session, steps_per_execution=1)
>>> state = setup.init((np.ones((8, 3), np.float32), np.ones((8, 2), np.float32)))
>>> session.state.params["kernel"].shape, setup.decided.require_strategy().describe(), setup.decided.steps_per_execution
((3, 2), 'SingleDevice(cpu:0)', 1)
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Sequence
from typing import NamedTuple

import jax

from trainkit import data as data_lib
from trainkit import distributed
from trainkit.core import checks
from trainkit.core import model as model_lib
from trainkit.core.state import TrainState, abstract
from trainkit.core.tree import PyTree, TreeFunction
from trainkit.data import DataInput
from trainkit.distributed import compile_cache
from trainkit.planning import ladder as ladder_lib
from trainkit.planning import plan as plan_lib
from trainkit.program import auto as auto_lib
from trainkit.program.compiled import CompiledFunctions
from trainkit.program.decisions import Decided, Decisions
from trainkit.program.program import Program
from trainkit.program.state_access import StateAccess
from trainkit.record.session import Session
from trainkit.strategies import Auto, SingleDevice, Strategy, check_steps_per_execution, resolve_strategy

logger = logging.getLogger("trainkit")

#: The examples ``summary`` traces the model with (a leading axis of this size is the batch).
SUMMARY_ROWS = 2


class SummaryInputs(NamedTuple):
    """What ``summary`` shows: abstract inputs ``x`` of a few examples, the ``state`` (live, or
    its shapes before a strategy is chosen), the placed sample batch to lower the train step
    on (``None``: the last ``fit``'s), or, traced without a strategy, its ``flops`` on a batch
    of ``flops_rows``."""

    x: PyTree
    state: TrainState
    step_batch: PyTree = None
    flops: float | None = None
    flops_rows: int | None = None


class Setup:
    """The strategy, the state and the compiled steps of one trainer (see the module docstring).

    Args:
        program: the pure functions of the setup.
        strategy: a strategy, a name, ``"auto"`` or an :class:`~trainkit.strategies.Auto`.
        steps_per_execution: batches per compiled training call, ``"auto"``, or ``None`` (the
            default): ``"auto"`` where the run repays the fused program's compile, else 1 (1
            under ``deterministic``, which picks nothing by timing).
        custom_loss: the trainer overrides ``compute_loss`` (targets are then optional).
        mixes_rows: the model mixes the rows of a batch on purpose (see :meth:`check_outputs`).
        deterministic: nothing is chosen by timing: ``"auto"`` ranks by the compiler's estimate,
            ``steps_per_execution="auto"`` is refused (the XLA flags are the trainer's).
        session: the trainer's session, which holds the live state.
    """

    def __init__(
        self,
        program: Program,
        strategy: str | Strategy | Auto,
        *,
        session: Session,
        steps_per_execution: int | str | None = None,
        custom_loss: bool = False,
        mixes_rows: bool = False,
        deterministic: bool = False,
    ):
        compile_cache.configure()  # compiled steps persist across runs (TRAINKIT_COMPILATION_CACHE)
        self.program, self.objective, self.custom_loss = program, program.objective, custom_loss
        self.mixes_rows = mixes_rows  # the model mixes a batch's rows on purpose: not checked
        chosen = resolve_strategy("single" if program.eager and strategy == "auto" else strategy)
        if program.eager and not isinstance(chosen, SingleDevice):
            raise ValueError(
                f"run_eagerly=True runs each step op by op on one device, but the strategy is {chosen.describe()}, "
                "which compiles the step across devices. Pass strategy='single' (or leave strategy='auto') to debug."
            )
        if program.offload and isinstance(chosen, Strategy) and not chosen.offloads:
            raise ValueError(chosen.no_offload())
        # offload="auto" under a strategy that can offload: planned at the first fit, offloaded only if it must be
        self.offload_decides = offload_decides(program, chosen)
        if self.offload_decides:
            assert isinstance(chosen, Strategy)
            chosen = Auto(measure=False, candidates=[chosen])
        self.auto: Auto | None = chosen if isinstance(chosen, Auto) else None
        if deterministic and steps_per_execution == "auto":
            raise ValueError(
                "steps_per_execution='auto' picks by timing the first steps, which differs from run to run, and "
                "deterministic=True promises the same run every time: pass an integer (1, or the k an earlier "
                "run's plan printed)."
            )
        if deterministic and self.auto is not None and self.auto.measure:  # ranked by estimate, not by timing
            self.auto = Auto(self.auto.memory_limit, measure=False, candidates=self.auto.candidates)
        strategy_now = chosen if isinstance(chosen, Strategy) else None  # "auto": set by the plan
        # "auto": 1 until the loop timed the first steps and picked (see trainkit.loop.tuning)
        by_default = steps_per_execution is None and not deterministic
        tunes = (steps_per_execution == "auto" or by_default) and not program.eager
        given = 1 if steps_per_execution in ("auto", None) else steps_per_execution
        self.decided = Decided(
            Decisions(strategy_now, check_steps_per_execution(given, strategy_now), tunes, by_default)
        )
        self.session = session
        self.state_access = StateAccess(program, session, self.decided)
        self.compiled = CompiledFunctions(program, self.decided, session.require_state)
        self._outputs: dict[str, PyTree] = {}  # the model's output shapes by input shapes, each traced once
        self._computation = ""  # a digest of the model's traced forward pass (what "auto" remembers a pick for)

    # ------------------------------------------------------------------ what it decided
    def describe_strategy(self) -> str:
        """The chosen strategy, or the ``"auto"`` it will be chosen by."""
        strategy = self.decided.value.strategy or self.auto
        assert strategy is not None  # one of the two, by construction
        return strategy.describe()

    # ------------------------------------------------------------------ the input
    def placed_sample(self, sample_batch: DataInput) -> PyTree:
        """A sample batch (any form ``fit`` takes) placed by the strategy, for lowering; ``None``
        for ``None`` or before the state exists."""
        if sample_batch is None or self.session.state is None:
            return None
        host_batch = data_lib.prepare(sample_batch, default_batch_size=None).sample_batch()
        self.compiled.empty_totals("train", host_batch)  # shaped before anything lowers the train step
        return self.decided.require_strategy().put_batch(host_batch)

    def inference(self, float32: bool = False) -> tuple[TreeFunction, PyTree, PyTree]:
        """What an export runs: ``predict``'s function ``(variables, x) -> outputs`` (eval mode,
        the precision policy, or with ``float32`` float32 computation), host copies of the
        variables it reads, and the per-example inputs."""
        host = distributed.fetch(self.session.require_state().replace(opt_state=()))  # no optimizer state
        program = self.program
        variables = {"params": program.merged_params(host.params), "model_state": host.model_state, "rng": host.rng}
        outputs = program.exported_outputs(float32)  # under LoRA the merged model: its kernels hold the adapters

        def predict(variables: PyTree, x: PyTree) -> PyTree:
            return outputs(host.replace(**variables), x)

        return predict, variables, self.decided.input_spec

    def summary_inputs(self, sample_batch: DataInput) -> SummaryInputs | None:
        """What ``summary`` shows (``None``: no state and no sample to trace): abstract inputs of
        ``SUMMARY_ROWS`` examples, the state (its shapes suffice), and the sample placed for
        lowering the train step when it has targets. A sample initialises a trainer with a
        strategy; under ``"auto"``, before anything chose one, the model and step are traced
        on it without choosing (no candidate compiled or timed)."""
        if sample_batch is not None and self.session.state is None and self.decided.strategy is None:
            prepared = data_lib.prepare(sample_batch, default_batch_size=None)
            state = self.program.abstract_state(prepared.first_x)
            x = data_lib.abstract_inputs(prepared.spec, SUMMARY_ROWS)
            if not prepared.has_targets:
                return SummaryInputs(x, state)
            self.build_objective(prepared)
            return SummaryInputs(
                x, state, None, self.program.step_flops(state, prepared.sample_batch()), prepared.batch_size
            )
        if sample_batch is not None:
            self.init(sample_batch)
        if self.session.state is None:
            return None
        step_batch = None
        if sample_batch is not None and data_lib.prepare(sample_batch, default_batch_size=None).source.has_targets:
            step_batch = self.placed_sample(sample_batch)
        x = data_lib.abstract_inputs(self.decided.input_spec, SUMMARY_ROWS)
        return SummaryInputs(x, self.session.require_state(), step_batch)

    def init(self, sample_batch: DataInput) -> TrainState:
        """The state for a sample batch (see :meth:`trainkit.Trainer.init`)."""
        prepared = data_lib.prepare(sample_batch, default_batch_size=None)
        if self.session.state is None:
            self.choose_strategy(prepared, measure=False)  # "auto" times candidates only to train (fit)
            self.create_state(prepared)
        data_lib.check_same_inputs(self.decided.input_spec, prepared.spec)
        return self.session.require_state()

    def create_state(self, prepared: data_lib.Prepared) -> None:
        """The state at step 0, placed by the strategy, the model initialised on the first real
        batch's inputs (as training will call it)."""
        plan, program, first_x = self.decided.last_plan, self.program, prepared.first_x
        if plan is not None and plan.initial_state is not None:
            # "auto" measured its candidates from this very state: no second init compile
            state = self.decided.require_strategy().put_state(plan.initial_state)
            self.decided.decide(plan=dataclasses.replace(plan, initial_state=None))  # host memory back
        else:
            strategy = program.configured(self.decided.require_strategy(), first_x)
            self.decided.decide(strategy=strategy)
            under = self.decided.value.initialise_under
            if under is None:
                state = program.create_state(strategy, first_x)
            else:  # as the run that remembered this pick built its state: that init is in the compile cache
                built = program.create_state(program.configured(under, first_x), first_x)
                state = strategy.put_state(distributed.fetch(built))
        self.decided.decide(input_spec=prepared.spec)
        self.session.replace_state(state)

    def output_spec(self, first_x: PyTree) -> PyTree:
        """The shapes of the model's outputs for the first batch (traced, never run; cached per input
        shapes: predict and evaluate may take sequences of another length). An error while tracing the
        model is raised again with the inputs it was given, and outputs without one row per input row
        are refused (the model mixes the batch axis)."""
        shapes = str(data_lib.example_spec(first_x))  # per example: the first batch's rows stand for any batch's
        if shapes not in self._outputs:
            try:
                live = self.session.state
                state = abstract(live) if live is not None else self.program.abstract_state(first_x)
                traced = jax.jit(self.program.outputs).trace(state, first_x)
                outputs = traced.out_info
            except checks.SettingError:
                raise  # trainkit's refusal of its own argument (params=, trainable=, optimizer=), not the model's
            except Exception as error:  # noqa: BLE001 - the model's own error, raised again with its inputs
                raise ValueError(
                    f"The model raised {type(error).__name__} when called on the first batch, whose inputs are "
                    f"{data_lib.describe_shapes(first_x)}: {error}\n{model_lib.call_error_hint(error)}"
                ) from error
            # shapes alone: the live state's frozen parameters may lie in host memory (offload="optimizer+frozen"),
            # which the model's own call cannot read; the layers are found all the same
            params, model_state = jax.tree.map(
                lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), (state.params, state.model_state)
            )
            unswitched = self.program.adapter.unswitched_layers(params, model_state, first_x)
            if unswitched:
                raise ValueError(
                    f"The model has layers that train differently from how they evaluate ({'; '.join(unswitched)}), "
                    f"but its __call__ takes none of the flags trainkit sets ({model_lib.TRAIN_FLAG_NAMES}), so they "
                    "would stay in one mode for training and evaluation alike. Rename the model's flag, e.g. "
                    "`def __call__(self, x, train: bool = False)` with nn.Dropout(rate, deterministic=not train) and "
                    "nn.BatchNorm(use_running_average=not train)."
                )
            if not self.custom_loss:  # a compute_loss of your own may use outputs that are not per row
                data_lib.check_rows_kept(first_x, outputs)
            self._outputs[shapes] = outputs
            self._computation = self._computation or hashlib.sha256(str(traced.jaxpr).encode()).hexdigest()[:16]
        return self._outputs[shapes]

    def build_objective(self, prepared: data_lib.Prepared, every: bool = False) -> None:
        """The objective built for the prepared targets and checked against the model's outputs
        (``every``: all labels of arrays, else the first batch's), so that a step compiled for
        a plan is the step ``fit`` compiles (the same in-step label check)."""
        self.objective.build(prepared.first_y)
        if self.objective.has_loss and not self.custom_loss:
            source = prepared.source
            targets = source.y if every and isinstance(source, data_lib.ArrayDataset) else prepared.first_y
            self.objective.check_targets(targets, self.output_spec(prepared.first_x))

    # ------------------------------------------------------------------ the plan and "auto"
    def plan(
        self,
        prepared: data_lib.Prepared,
        candidates: Sequence[Strategy] | None,
        settings: plan_lib.PlanSettings,
        *,
        verbose: int = 0,
        abstract: bool = False,
        ladder: bool = True,
    ) -> plan_lib.MemoryPlan:
        """:meth:`trainkit.Trainer.plan` of a prepared input (``abstract``: compiled on its shapes
        alone, nothing placed). When no candidate's train step fits, the memory measures are
        tried in turn (:mod:`trainkit.planning.ladder`; ``ladder=False``: not)."""
        trains = prepared.has_targets or self.custom_loss
        if prepared.has_targets:
            self.build_objective(prepared)
        if abstract:
            settings = dataclasses.replace(settings, place_batch=False)
        batch, statistics, program = prepared.sample_batch(abstract=abstract), self.compiled.statistics, self.program

        def planned(among: Sequence[Strategy] | None) -> plan_lib.MemoryPlan:
            return program.plan(batch, among, trains=trains, statistics=statistics, settings=settings)

        result = planned(candidates)
        if trains and ladder:
            result = ladder_lib.climbed(result, lambda: self.ladder(prepared.first_x), planned)
        if verbose:
            result.print()
        return result

    def ladder(self, first_x: PyTree) -> list[ladder_lib.Rung]:
        """The memory measures a plan tries when nothing fits, for this trainer: remat of the
        repeated blocks unless it has remat (or only the offload is the plan's to decide: ``offload="auto"``
        under a given strategy), optimizer offload unless it offloads (or cannot)."""
        program = self.program
        blocks = program.repeated_blocks(first_x) if program.remat is None and not self.offload_decides else []
        return ladder_lib.ladder(blocks, can_offload=not program.offload and program.offload_refusal is None)

    def choose_strategy(
        self, prepared: data_lib.Prepared, announce: bool = False, measure: bool = True, run_steps: int | None = None
    ) -> None:
        """Under ``"auto"``: the strategy :func:`trainkit.program.auto.choose` picks, before
        anything else is compiled or placed (also for ``evaluate`` and ``predict`` before
        ``fit``), applied; ``announce``: said on the main process."""
        if self.decided.strategy is not None:
            return
        choice = auto_lib.choose(self, prepared, measure, run_steps)
        self.decided.decide(strategy=choice.strategy, initialise_under=choice.initialise_under)
        if choice.plan is not None:
            self.decided.decide(plan=choice.plan)
        if choice.train_step is not None:
            self.compiled.adopt("train", choice.train_step, choice.compile_seconds)  # compiled by the plan, not again
        chooser = "offload='auto'" if self.offload_decides else "strategy='auto'"
        logger.info("%s %s", chooser, choice.reason)
        if announce and distributed.is_main_process():
            print(f"{chooser} {choice.reason}")

    def require_auto(self) -> Auto:
        if self.auto is None:
            raise RuntimeError("The strategy was given, not strategy='auto': there is nothing to choose.")
        return self.auto

    def computation(self, first_x: PyTree) -> str:
        """A digest of the model's forward pass traced on ``first_x`` (what ``"auto"`` remembers a pick for)."""
        self.output_spec(first_x)  # traced once
        return self._computation


def offload_decides(program: Program, chosen: Strategy | Auto) -> bool:
    """Whether ``offload="auto"`` makes the plan decide for the given strategy ``chosen``: it can
    offload and the settings allow it (else it trains as given, nothing offloaded; under
    ``strategy="auto"`` the plan decides anyway)."""
    allowed = program.offload.auto and program.offload_refusal is None
    return allowed and isinstance(chosen, Strategy) and chosen.offloads
