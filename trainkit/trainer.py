"""``Trainer``: Keras-style ``fit`` / ``evaluate`` / ``predict`` for a Flax module and optax.

A facade: it keeps the model, loss, optimizer, strategy, state and compiled steps, and hands
iteration to :class:`trainkit.loop.Loop`, planning to :mod:`trainkit.program.plan`, bytes on disk to
:mod:`trainkit.checkpoint` and devices to the strategy.

>>> import numpy as np, optax, flax.linen as nn
>>> x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
>>> y = (x.sum(axis=1) > 0).astype("int32")
>>> trainer = Trainer(nn.Dense(2), loss="sparse_categorical_crossentropy",
...                   optimizer=optax.adam(0.1), metrics=["accuracy"], strategy="single")
>>> history = trainer.fit((x, y), epochs=3, batch_size=16, verbose=0)
>>> loss, accuracy = trainer.evaluate((x, y))   # as Keras; return_dict=True gives a dict
>>> len(history.history["loss"]), accuracy > 0.8
(3, True)
>>> trainer.predict(x[:5]).shape
(5, 2)
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
import optax

from trainkit import checkpoint as checkpoint_lib
from trainkit import data as data_lib
from trainkit import distributed
from trainkit.callbacks import Callback, CallbackList, History, ProgressBar, TerminateOnNaN
from trainkit.core import optimizers
from trainkit.core.model import adapt_model
from trainkit.core.precision import NoLossScale, Precision, get_precision
from trainkit.core.remat import wrap_remat
from trainkit.core.state import Batch, TrainState, abstract, check_tree_matches
from trainkit.distributed import compile_cache
from trainkit.loop import Loop, Position, validates
from trainkit.monitoring import debug
from trainkit.objective import Objective, losses
from trainkit.objective import metrics as metrics_lib
from trainkit.program import plan as plan_lib
from trainkit.program.program import Program
from trainkit.strategies import Auto, SingleDevice, Strategy, resolve_strategy
from trainkit.strategies.base import check_steps_per_execution

PyTree = Any
logger = logging.getLogger("trainkit")


class Trainer:
    """Trains a Flax module with a loss and an optax optimizer on any strategy.

    Args:
        model: a ``flax.linen.Module`` or ``flax.nnx.Module``. A ``train``, ``training`` or
            ``deterministic`` argument of its ``__call__`` is set by the Trainer.
        loss: a name (``"sparse_categorical_crossentropy"``, ``"categorical_crossentropy"``,
            ``"binary_crossentropy"``, ``"mse"``, ``"mae"``, ...; cross-entropies by name take
            logits), a loss object (``tk.losses.BinaryCrossentropy(from_logits=False)``, or a
            Keras one), or a callable ``loss(predictions, targets)`` returning per-example
            values or a mean. For a model with several outputs: one loss for all, a list (one
            per output) or a dict by output name (see :mod:`trainkit.objective`).
        optimizer: any ``optax.GradientTransformation``.
        metrics: names (``"accuracy"``, ``"auc"``, ``"precision"``, ...), metric objects
            (``tk.metrics.AUC()``) or callables ``metric(predictions, targets)``; each real row
            counts once (sample weights do not apply, as in Keras). Several outputs: a dict
            ``{output: [metrics]}`` or a list with one entry per output.
        weighted_metrics: metrics that the sample weights (and ``class_weight``) apply to; a
            name already in ``metrics`` is logged as ``weighted_<name>``.
        loss_weights: a float (one output), or a list or dict with one weight per output: the
            loss is ``sum(weight * output_loss)``.
        strategy: a :class:`trainkit.Strategy`, ``"auto"`` (the default: chosen from the
            compiled plan when the trainer first sees data), a name, or a
            :class:`trainkit.strategies.Auto`.
        seed: seeds initialisation, dropout and the shuffle order.
        params: variables to start from (``{"params": ..., "batch_stats": ...}`` or just the
            parameter tree), for fine-tuning.
        precision: ``"fp32"`` (default), ``"bf16"``, ``"fp16"`` (mixed, dynamic loss
            scaling) or a :class:`trainkit.Precision`.
        remat: ``None``, ``"full"``, ``"dots"``, ``"dots_no_batch"``, a ``jax.checkpoint``
            policy, or a list of Flax submodule class names to rematerialise.
        grad_accum_steps: split each global batch into this many micro-batches inside one
            compiled step; the update equals the whole batch's.
        log_grad_norm: also log the global gradient norm of every step (``grad_norm``); one
            more pass over the gradients (free when the optimizer clips by global norm).
        steps_per_execution: train this many batches per compiled call (a ``lax.scan`` over
            them): one dispatch instead of ``k``, for small models whose step is shorter
            than Python's dispatch. Results equal ``1``'s to float rounding; the batch hooks
            run once per call, as in Keras (``trainer.loop.record`` says which steps it
            covered).
        run_eagerly: run every step op by op, uncompiled, on one device, so that ``print``,
            ``breakpoint()`` and pdb work inside the model and the loss (slow: for debugging).
        jit_compile: Keras's switch: ``False`` is ``run_eagerly=True``; ``True`` and ``"auto"``
            compile (the default).

    Override :meth:`compute_loss` to train a model whose loss is not ``loss(preds, y)``.
    """

    def __init__(
        self,
        model: Any,
        *,
        loss: str | losses.LossFn | None = None,
        optimizer: optax.GradientTransformation,
        metrics: Sequence[str | metrics_lib.MetricFn] | dict | None = None,
        weighted_metrics: Sequence[str | metrics_lib.MetricFn] | dict | None = None,
        loss_weights: float | Sequence[float] | dict | None = None,
        strategy: str | Strategy | Auto = "auto",
        seed: int = 0,
        params: PyTree | None = None,
        precision: str | Precision | None = "fp32",
        remat: Any = None,
        grad_accum_steps: int = 1,
        log_grad_norm: bool = False,
        steps_per_execution: int = 1,
        run_eagerly: bool = False,
        jit_compile: bool | str = "auto",
    ):
        distributed.initialize_from_environment()  # a multi-process job: connect first
        compile_cache.configure()  # compiled steps persist across runs (TRAINKIT_COMPILATION_CACHE)
        self.model = model
        self._adapter = adapt_model(model)
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(
                f"optimizer must be an optax.GradientTransformation such as optax.adam(1e-3); "
                f"received {type(optimizer).__name__}."
            )
        if loss is None and type(self).compute_loss is Trainer.compute_loss:
            raise ValueError("Pass loss=..., or subclass Trainer and override compute_loss.")
        if not isinstance(grad_accum_steps, (int, np.integer)) or grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be a positive integer; received {grad_accum_steps!r}.")
        self.loss = loss
        self.objective = Objective(loss, metrics, weighted_metrics, loss_weights)
        self.optimizer = optimizer
        if jit_compile not in (True, False, "auto"):
            raise ValueError(f"jit_compile must be True, False or 'auto'; received {jit_compile!r}.")
        self.run_eagerly = bool(run_eagerly) or jit_compile is False
        chosen = resolve_strategy("single" if self.run_eagerly and strategy == "auto" else strategy)
        if self.run_eagerly and not isinstance(chosen, SingleDevice):
            raise ValueError(
                f"run_eagerly=True runs each step op by op on one device, but the strategy is {chosen.describe()}, "
                "which compiles the step across devices. Pass strategy='single' (or leave strategy='auto') to debug."
            )
        self._auto = chosen if isinstance(chosen, Auto) else None
        self.strategy: Strategy | None = None if self._auto else chosen  # "auto": set by the plan
        self.seed = int(seed)
        self.precision = get_precision(precision)
        self.grad_accum_steps = int(grad_accum_steps)
        self.log_grad_norm = bool(log_grad_norm)
        self.steps_per_execution = check_steps_per_execution(steps_per_execution, self.strategy)
        self.remat = remat
        self._apply = self.precision.wrap_apply(wrap_remat(self._adapter, remat))
        self.program = Program(
            adapter=self._adapter,
            compute_loss=self.compute_loss,
            apply=self.apply,
            optimizer=optimizer,
            objective=self.objective,
            precision=self.precision,
            grad_accum_steps=self.grad_accum_steps,
            log_grad_norm=self.log_grad_norm,
            eager=self.run_eagerly,
            seed=self.seed,
            variables=params,
        )
        self.state: TrainState | None = None
        self.input_spec: PyTree | None = None
        self._compiled: dict[str, Any] = {}
        self.loop = Loop(self)
        self.history: History | None = None
        self.last_plan: plan_lib.MemoryPlan | None = None  # the plan strategy="auto" chose from
        self._warned_probabilities = False
        self._outputs: PyTree = None  # the model's output shapes, once traced

    # ------------------------------------------------------------------ override points
    def apply(self, params: PyTree, model_state: PyTree, x: PyTree, *, rng: jax.Array, train: bool):
        """Runs the model: ``(outputs, new_model_state)`` under the precision policy and remat
        setting. Pure; usable inside ``compute_loss``."""
        return self._apply(params, model_state, x, rng=rng, train=train)

    def compute_loss(
        self, params: PyTree, batch: Batch, rng: jax.Array, *, model_state: PyTree, train: bool
    ) -> tuple[jax.Array, tuple[PyTree, PyTree]]:
        """The loss of a batch: ``(per_example_loss, (predictions, new_model_state))``.

        ``batch`` holds ``"x"``, ``"y"`` (when given), ``"mask"`` and maybe
        ``"sample_weight"``; trainkit applies the mask and weights, so return one value per
        row (a scalar is taken as the mean over the rows). The function must stay pure.
        """
        predictions, model_state = self.apply(params, model_state, batch["x"], rng=rng, train=train)
        return self.objective.loss(predictions, batch["y"]), (predictions, model_state)

    @property
    def metric_fns(self) -> dict[str, metrics_lib.MetricFn]:
        """The metrics by their names in the logs (per output for several outputs)."""
        return self.objective.metric_fns

    @property
    def log_order(self) -> tuple[str, ...]:
        return self.objective.log_order

    @property
    def _custom_loss(self) -> bool:
        return type(self).compute_loss is not Trainer.compute_loss

    @property
    def _logits_loss(self) -> bool:
        return not self._custom_loss and bool(self.objective.probes)

    def _check_first_step(self, metrics: dict) -> None:
        """Warns once when a loss that takes logits received outputs that look like
        probabilities (a model ported from Keras with a final softmax or sigmoid)."""
        for probe_name in self.objective.probes:
            probe = metrics.get(probe_name)
            if probe is None or self._warned_probabilities or not probe.count or probe.total < probe.count:
                continue
            self._warned_probabilities = True
            warnings.warn(
                f"The model's outputs look like probabilities (every row non-negative and summing to 1, or in [0, 1] "
                f"for one output), but the loss {self.objective.loss_named(probe_name)!r} takes logits: trainkit's "
                "cross-entropies by name are Keras's with from_logits=True, so this trains on another loss than "
                "Keras would. Remove the final softmax / sigmoid, or pass a loss object that reads probabilities, "
                "such as tk.losses.SparseCategoricalCrossentropy() (Keras's default from_logits=False).",
                stacklevel=4,
            )

    # ------------------------------------------------------------------ what callbacks use
    @property
    def stop_training(self) -> bool:
        """Keras's flag: set it to ``True`` in a callback to stop before the next batch."""
        return self.loop.stop_requested

    @stop_training.setter
    def stop_training(self, value: bool) -> None:
        self.loop.request_stop() if value else setattr(self.loop, "stop_requested", False)

    @property
    def global_step(self) -> int:
        """Optimizer steps applied (dispatched) so far."""
        return self.loop.position.step

    @property
    def learning_rate(self) -> float:
        """The optimizer's learning rate (needs ``optax.inject_hyperparams``); settable."""
        return float(distributed.fetch(optimizers.require_learning_rate(self._require_state().opt_state)))

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        opt_state = self._require_state().opt_state
        self.update_state(opt_state=optimizers.set_learning_rate(opt_state, value))

    def update_state(self, **fields: PyTree) -> TrainState:
        """The one way to write the live state (callbacks such as ``SwapEMAWeights`` and the
        learning-rate setter use it): the given fields (``params``, ``opt_state``, ...), host or
        device values, placed in the shardings of the fields they replace. The loop reads the
        state before every step, so the change applies from the next step on."""
        state = self._require_state()
        self.state = self.strategy.put_like(state.replace(**fields), state)  # unchanged arrays stay as they are
        return self.state

    # ------------------------------------------------------------------ state
    def init(self, sample_batch: Any) -> TrainState:
        """Builds the state from a sample batch (``x``, ``(x, y)`` or a data source) without
        training; under ``"auto"`` the strategy is chosen first. A second call keeps the state.
        A source is read no further than its first batch."""
        prepared = data_lib.prepare(sample_batch, default_batch_size=None)
        if self.state is None:
            self._choose_strategy(prepared)
            self._create_state(prepared)
        data_lib.check_same_inputs(self.input_spec, prepared.spec)
        return self.state

    def _create_state(self, prepared: data_lib.Prepared) -> None:
        """The state at step 0, placed by the strategy, the model initialised on the first real
        batch's inputs (as training will call it)."""
        first_x = prepared.first_x
        planned = self.last_plan.initial_state if self.last_plan is not None else None
        if planned is not None:  # "auto" measured its candidates from this very state: no second init compile
            self.program.annotate(self.strategy, first_x)
            self.state = self.strategy.put_state(planned)
            self.last_plan.initial_state = None  # host memory back
        else:
            self.state = self.program.create_state(self.strategy, first_x)
        self.input_spec = prepared.spec
        self.loop.restored(int(self.state.step))

    def _require_state(self) -> TrainState:
        if self.state is None:
            raise RuntimeError("The trainer has no state yet: call fit(...) or init(sample_batch) first.")
        return self.state

    @property
    def params(self) -> PyTree:
        """The parameters as host NumPy arrays."""
        return jax.tree.map(np.asarray, distributed.fetch(self._require_state().params))

    def count_params(self) -> int:
        """The number of scalars in all variables (parameters and model state), as Keras counts."""
        state = self._require_state()
        return int(sum(np.prod(leaf.shape) for leaf in jax.tree.leaves((state.params, state.model_state))))

    def summary(self, console: Any = None) -> None:
        """Prints Keras's ``summary()``: each layer's variables, shapes and parameter counts, and
        the totals (trainable parameters and non-trainable model state)."""
        from rich.console import Console

        (console or Console()).print(debug.summary_table(self))

    def get_weights(self) -> PyTree:
        """Host copies of all variables: ``{"params": ..., **model_state}``."""
        state = self._require_state()
        host = distributed.fetch({"params": state.params, "model_state": state.model_state})
        return {"params": host["params"], **host["model_state"]}

    def set_weights(self, variables: PyTree) -> None:
        """Puts variables from :meth:`get_weights` back into the live state (same shapes)."""
        state = self._require_state()
        variables = dict(variables)
        params = variables.pop("params")
        check_tree_matches("set_weights", (state.params, state.model_state), (params, variables))
        self.update_state(params=params, model_state=variables)

    # ------------------------------------------------------------------ checkpoints
    def manifest(self) -> dict:
        """What a checkpoint records besides the arrays (JSON; see docs/checkpointing.md)."""
        return checkpoint_lib.build_manifest(
            self._require_state(),
            self.strategy,
            self.loop.position,
            precision=str(self.precision.compute_dtype),
            seed=self.seed,
            batch_size=self.loop.batch_size,
            grad_accum_steps=self.grad_accum_steps,
            **({} if self.loop.data_state is None else {"data_state": distributed.gather_json(self.loop.data_state)}),
        )

    def save(
        self,
        filepath: str | os.PathLike,
        *,
        max_to_keep: int | None = None,
        weights_only: bool = False,
        overwrite: bool = True,
        allow_non_finite: bool = False,
    ) -> int:
        """Writes the full state (or only the variables) and the manifest to ``filepath``, an
        orbax checkpoint directory, at the current step; waits until it is on disk. Returns
        the step. A checkpoint of the same step in ``filepath`` is replaced (Keras's
        ``overwrite=True``), or with ``overwrite=False`` a :class:`CheckpointError` is raised.
        Parameters that are not all finite are refused unless ``allow_non_finite``."""
        checkpointer = checkpoint_lib.Checkpointer(filepath, max_to_keep=max_to_keep, enable_async=False)
        try:
            step, state = self.global_step, self._require_state()
            if not overwrite and step in checkpointer.steps():
                raise checkpoint_lib.CheckpointError(
                    f"{checkpointer.directory!r} already holds step {step}; pass overwrite=True to replace it."
                )
            if not allow_non_finite and not checkpoint_lib.all_finite(state.params):
                raise checkpoint_lib.CheckpointError(
                    f"The parameters at step {step} are not all finite (NaN or inf); nothing was written to "
                    f"{checkpointer.directory!r}. Pass allow_non_finite=True to save them anyway (for debugging)."
                )
            checkpointer.save(
                step,
                state,
                self.manifest(),
                wait=True,
                weights_only=weights_only,
                overwrite=True,
                allow_non_finite=True,  # judged above
            )
        finally:
            checkpointer.close()
        return self.global_step

    def load(self, directory: str | os.PathLike | checkpoint_lib.Checkpointer, step: int | None = None) -> dict:
        """Restores the state (the latest checkpoint, or ``step``) into this trainer's strategy
        and shardings; the checkpoint may come from another strategy or device count, and may
        hold only the variables (``save_weights_only``). Call ``init(sample_batch)`` first.
        Returns the checkpoint's manifest."""
        if self.state is None:
            raise RuntimeError(
                "load() restores into the trainer's state: call init(sample_batch) (or fit) first, "
                "so that the model's shapes are known."
            )
        own = not isinstance(directory, checkpoint_lib.Checkpointer)
        checkpointer = checkpoint_lib.Checkpointer(directory, read_only=True) if own else directory
        try:
            self.state, manifest = checkpointer.restore(self.state, step)
        finally:
            if own:
                checkpointer.close()
        if manifest.get("contents") != "weights":
            self.loop.restored(int(self.state.step))
        saved = Position(manifest["position"]["epoch"], manifest["position"]["batch"])
        checkpoint_lib.explain_restore(
            manifest,
            type(self.strategy).__name__,
            len(self.strategy.devices),
            self.loop.batch_size,
            saved.rebatched(manifest.get("batch_size"), self.loop.batch_size).batch,
        )
        return manifest

    # ------------------------------------------------------------------ compiled steps
    def function(self, kind: str):
        """The compiled ``"train"``, ``"eval"`` or ``"predict"`` step (compiled once)."""
        if kind not in self._compiled:
            self._compiled[kind] = self.program.compile(kind, self.strategy, abstract(self._require_state()))
        return self._compiled[kind]

    def lowered_text(self, sample_batch: Any = None) -> str:
        """The train step as StableHLO text, before compiler optimisation. ``sample_batch``
        defaults to the last ``fit``'s batch shape."""
        return debug.lower_train_step(self, self._placed_sample(sample_batch)).as_text()

    def compiled_text(self, sample_batch: Any = None) -> str:
        """The train step as optimised HLO after partitioning: the collectives the compiler
        inserted (``all-gather``, ``reduce-scatter``, ``all-reduce``) are visible here."""
        return debug.lower_train_step(self, self._placed_sample(sample_batch)).compile().as_text()

    def _placed_sample(self, sample_batch: Any) -> Any:
        if sample_batch is None or self.state is None:
            return None
        x, y, w = data_lib.split_xyw(sample_batch)
        return self.strategy.put_batch(data_lib.pad_batch(x, y, w, data_lib.num_rows(x)))

    # ------------------------------------------------------------------ planning
    def plan(
        self,
        sample_batch: Any,
        *,
        batch_size: int | None = None,
        candidates: Sequence[Strategy] | None = None,
        measure: bool = False,
        memory_limit: int | None = None,
        steps: int = plan_lib.MEASURE_STEPS,
        verbose: int = 1,
    ) -> plan_lib.MemoryPlan:
        """Compiles the real train step under each candidate strategy and reports, per device,
        the argument / output / temporary / total bytes, flops, bytes moved by collectives,
        and an estimated (or with ``measure=True`` measured) step time. ``sample_batch`` is a
        batch in any form ``fit`` takes; ``batch_size`` (default: its rows) the global batch
        to plan for. A batch without targets plans the predict step instead. ``verbose=1``
        prints the table; the recommended row is what ``strategy="auto"`` picks."""
        prepared = data_lib.prepare(sample_batch, batch_size=batch_size, default_batch_size=None)
        return self._plan(
            prepared, candidates, measure=measure, memory_limit=memory_limit, steps=steps, verbose=verbose
        )

    def _plan(self, prepared: data_lib.Prepared, candidates, *, verbose: int = 0, **options) -> plan_lib.MemoryPlan:
        trains = prepared.has_targets or self._custom_loss
        if prepared.has_targets:
            self.objective.build(prepared.first_y)
        result = self.program.plan(prepared.sample_batch(), candidates, trains=trains, **options)
        if verbose:
            result.print()
        return result

    def _choose_strategy(self, prepared: data_lib.Prepared, announce: bool = False) -> None:
        """Under ``"auto"``: the strategy the compiled plan recommends, before anything else is
        compiled or placed (also for ``evaluate`` and ``predict`` before ``fit``)."""
        if self.strategy is not None:
            return
        auto = self._auto
        result = self._plan(
            prepared,
            auto.candidates,
            measure=auto.measure,
            memory_limit=auto.memory_limit,
            steps=plan_lib.MEASURE_STEPS,
        )
        best = result.recommended
        if best is None:
            raise ValueError(
                f"strategy='auto' found no strategy that runs this model and batch: {result.reason()}. "
                "Lower the batch size, pass remat='full' or grad_accum_steps=k, or pass "
                f"strategy=tk.strategies.Auto(memory_limit=...) or a strategy.\n{result}"
            )
        self.strategy, self.last_plan = best.strategy, result
        if best.function is not None and (prepared.has_targets or self._custom_loss):
            self._compiled["train"] = best.function  # compiled during the plan: not compiled again
        logger.info("strategy='auto' %s", result.reason())
        if announce and distributed.is_main_process():
            print(f"strategy='auto' {result.reason()}")

    # ------------------------------------------------------------------ fit / evaluate / predict
    def _prepare(
        self,
        data,
        y,
        sample_weight,
        batch_size,
        *,
        targets: bool,
        training: bool = False,
        announce: bool = False,
        config: dict | None = None,
    ) -> data_lib.Prepared:
        """The input resolved once, checked across processes, the objective built and checked on
        it, the strategy chosen and the state created from it."""
        prepared = data_lib.prepare(data, y, sample_weight, batch_size, needs_targets=targets and not self._custom_loss)
        source, batch_size = prepared.source, prepared.batch_size
        distributed.check_same_configuration(
            {  # before anything that needs the processes to agree
                "batch_size": batch_size,
                "seed": self.seed,
                "grad_accum_steps": self.grad_accum_steps,
                "steps_per_execution": self.steps_per_execution,  # different calls would hang a collective
                "strategy": (self.strategy or self._auto).describe(),
                "precision": str(self.precision.compute_dtype),
                "inputs": str(prepared.spec),
                "rows": prepared.rows,  # different counts would hang a collective
                "batches": source.steps(batch_size),
                **(config or {}),
            }
        )
        if self.state is not None:
            data_lib.check_same_inputs(self.input_spec, prepared.spec)
        if targets and prepared.has_targets:
            self.objective.build(prepared.first_y)
            if self.objective.has_loss and not self._custom_loss:
                every = source.y if isinstance(source, data_lib.ArrayDataset) else prepared.first_y
                self.objective.check_targets(every, self._output_spec(prepared.first_x))
        micro_batches = self.grad_accum_steps if training else 1
        if self.strategy is None:
            data_lib.check_batch_size(batch_size, 1, micro_batches=micro_batches)
            self._choose_strategy(prepared, announce)
        data_lib.check_batch_size(batch_size, self.strategy.num_batch_shards, micro_batches=micro_batches)
        if self.state is None:
            self._create_state(prepared)
        return prepared

    def _output_spec(self, first_x: PyTree) -> PyTree:
        """The shapes of the model's outputs for the first batch (traced, never run; cached)."""
        if self._outputs is None:
            state = abstract(self.state) if self.state is not None else self.program.abstract_state(first_x)
            self._outputs = jax.eval_shape(
                lambda s, x: self.apply(s.params, s.model_state, x, rng=s.rng, train=False)[0], state, first_x
            )
        return self._outputs

    def fit(
        self,
        x: Any = None,
        y: PyTree = None,
        *,
        epochs: int = 1,
        batch_size: int | None = None,
        validation_data: Any = None,
        validation_split: float = 0.0,
        validation_freq: int | list[int] = 1,
        validation_interval: int | None = None,
        validation_steps: int | None = None,
        validation_batch_size: int | None = None,
        shuffle: bool = True,
        sample_weight: PyTree = None,
        class_weight: dict | None = None,
        steps_per_epoch: int | None = None,
        max_steps: int | None = None,
        initial_epoch: int = 0,
        callbacks: Iterable[Callback] = (),
        verbose: int = 1,
    ) -> History:
        """Trains for ``epochs`` epochs (or ``max_steps`` optimizer steps) and returns a Keras
        ``History``. Keras's arguments: ``x`` (arrays, a tuple, an iterable of batches or a data
        library's dataset: docs/data.md), ``validation_split`` (the last fraction of the arrays),
        ``validation_freq``, ``validation_steps``, ``class_weight``. Callbacks run in Keras 3's order: yours, then
        ``History``, then the progress bar (``verbose``). ``validation_interval=N`` (trainkit's,
        for step-based training with ``max_steps``) validates after every N optimizer steps
        instead of at epoch ends: ``history.validations`` lists them."""
        data_lib.check_positive(
            epochs=epochs, steps_per_epoch=steps_per_epoch, max_steps=max_steps, validation_interval=validation_interval
        )
        if validation_interval is not None and validation_data is None and not validation_split:
            raise ValueError(
                f"validation_interval={validation_interval} needs validation_data (or validation_split): "
                "there is nothing to validate on."
            )
        validates(0, validation_freq)  # a bad validation_freq or shuffle is refused before anything runs
        data_lib.check_shuffle(shuffle)
        dataset = data_lib.as_dataset(x, y, sample_weight)
        if validation_split and validation_data is None:
            dataset, validation_data = data_lib.split_validation(dataset, validation_split)
        if class_weight is not None:
            dataset = data_lib.with_class_weight(dataset, class_weight)
        loop_config = {
            "epochs": epochs,
            "shuffle": shuffle,
            "steps_per_epoch": steps_per_epoch,
            "max_steps": max_steps,
            "initial_epoch": initial_epoch,
        }
        dataset, batch_size, *_ = self._prepare(
            dataset, None, None, batch_size, targets=True, training=True, announce=bool(verbose), config=loop_config
        )
        validation = None
        if validation_data is not None:
            data_lib.check_positive(validation_steps=validation_steps)
            validation_set = data_lib.as_dataset(validation_data)
            data_lib.check_validation_runs(
                validation_set,
                (max_steps or 2 * validation_interval) // validation_interval
                if validation_interval
                else sum(validates(e, validation_freq) for e in range(initial_epoch, epochs)),
                validation_steps,
            )
            own_size = isinstance(validation_set, data_lib.IterableDataset)  # an iterable's batches are its own
            validation = (
                *self._prepare(
                    validation_set,
                    None,
                    None,
                    validation_batch_size or (None if own_size else batch_size),
                    targets=True,
                )[:2],
                validation_steps,
            )
        steps = data_lib.epoch_steps(dataset, batch_size, steps_per_epoch, epochs)
        self.history = History()
        callbacks = [*callbacks, self.history]
        if verbose and distributed.is_main_process() and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(ProgressBar(verbose))
        callback_list = CallbackList(
            callbacks, trainer=self, params={"verbose": verbose, "epochs": epochs, "steps": steps}
        )
        logger.info("fit: %s, batch_size=%d, %s steps/epoch", self.strategy.describe(), batch_size, steps)
        no_nan_guard = isinstance(self.state.loss_scale, NoLossScale) and not any(
            isinstance(c, TerminateOnNaN) for c in callbacks
        )
        self.loop.fit(
            dataset,
            batch_size,
            callback_list,
            epochs=epochs,
            initial_epoch=initial_epoch,
            steps=steps,
            max_steps=max_steps,
            shuffle=shuffle,
            seed=self.seed,
            validation=validation,
            validation_freq=validation_freq,
            validation_interval=validation_interval,
            warn_non_finite=no_nan_guard,
            first_step=self._check_first_step if self._logits_loss else None,
            continuing=data_lib.continues_across_epochs(dataset, batch_size, steps_per_epoch),
        )
        return self.history

    def evaluate(
        self,
        x: Any = None,
        y: PyTree = None,
        *,
        batch_size: int | None = None,
        sample_weight: PyTree = None,
        steps: int | None = None,
        callbacks: Iterable[Callback] = (),
        verbose: int = 0,
        return_dict: bool = False,
    ) -> float | list[float] | dict[str, float]:
        """The loss and metrics over the whole dataset, exact for any device count. As Keras:
        the loss alone (no metrics) or ``[loss, *metrics]`` in the compiled order, and with
        ``return_dict=True`` the dict ``{"loss": ..., "accuracy": ...}``. ``verbose`` is accepted
        for Keras compatibility; evaluation prints nothing."""
        data_lib.check_positive(steps=steps)
        dataset, batch_size, *_ = self._prepare(x, y, sample_weight, batch_size, targets=True)
        params = {"verbose": verbose, "epochs": 1, "steps": dataset.steps(batch_size) if steps is None else steps}
        logs = self.loop.evaluate(dataset, batch_size, steps, CallbackList(callbacks, trainer=self, params=params))
        return self._keras_result(logs, return_dict)

    def _keras_result(self, logs: dict[str, float], return_dict: bool) -> float | list[float] | dict[str, float]:
        """Keras's return value: the dict, or the loss alone, or ``[loss, *metrics]``."""
        if return_dict:
            return logs
        values = [logs[k] for k in self.log_order if k in logs] + [
            v for k, v in sorted(logs.items()) if k not in self.log_order
        ]
        return values[0] if len(values) == 1 else values

    def _one_batch_size(self, x: Any) -> int:
        """A batch size that holds all of ``x`` in one batch the devices can split (padded)."""
        rows = data_lib.num_rows(data_lib.split_xyw(x)[0])
        shards = self.strategy.num_batch_shards if self.strategy is not None else 1
        return -(-rows // shards) * shards

    def train_on_batch(
        self,
        x: Any,
        y: PyTree = None,
        sample_weight: PyTree = None,
        class_weight: dict | None = None,
        return_dict: bool = False,
    ) -> float | list[float] | dict[str, float]:
        """One optimizer step on exactly these rows (Keras's ``train_on_batch``); returns that
        batch's loss and metrics like :meth:`evaluate`. The rows are padded to a size the
        devices can split, so any number of rows works on any strategy."""
        self.fit(
            x,
            y,
            sample_weight=sample_weight,
            class_weight=class_weight,
            batch_size=self._one_batch_size(x),
            epochs=1,
            shuffle=False,
            verbose=0,
        )
        return self._keras_result({k: v[-1] for k, v in self.history.history.items()}, return_dict)

    def test_on_batch(
        self, x: Any, y: PyTree = None, sample_weight: PyTree = None, return_dict: bool = False
    ) -> float | list[float] | dict[str, float]:
        """The loss and metrics of exactly these rows (Keras's ``test_on_batch``)."""
        return self.evaluate(
            x, y, sample_weight=sample_weight, batch_size=self._one_batch_size(x), return_dict=return_dict
        )

    def predict_on_batch(self, x: Any) -> PyTree:
        """The outputs of exactly these rows (Keras's ``predict_on_batch``)."""
        return self.predict(x, batch_size=self._one_batch_size(x))

    def predict(
        self,
        x: Any = None,
        *,
        batch_size: int | None = None,
        steps: int | None = None,
        callbacks: Iterable[Callback] = (),
        verbose: int = 0,
    ) -> PyTree:
        """Model outputs with exactly one row per input row (padding removed): an array, or a
        pytree of arrays for models with several outputs. ``x`` takes the forms ``fit``
        takes (targets, if present, are ignored), and, as in Keras, a list or tuple of arrays
        is the inputs of a model with several (``predict((x1, x2))``)."""
        if isinstance(x, tuple) and len(x) > 1 and data_lib.is_array_tree(x):
            x = (x,)  # Keras: predict's x is the inputs, whatever their structure
        data_lib.check_positive(steps=steps)
        dataset, batch_size, *_ = self._prepare(x, None, None, batch_size, targets=False)
        params = {"verbose": verbose, "epochs": 1, "steps": dataset.steps(batch_size) if steps is None else steps}
        return self.loop.predict(dataset, batch_size, steps, CallbackList(callbacks, trainer=self, params=params))
