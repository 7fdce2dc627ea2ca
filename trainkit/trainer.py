"""``Trainer``: Keras-style ``fit`` / ``evaluate`` / ``predict`` for a Flax module and optax.

It wires the pieces (model adapter, pure steps, strategy, data, callbacks) and owns the loop.

>>> import numpy as np, optax, flax.linen as nn
>>> x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
>>> y = (x.sum(axis=1) > 0).astype("int32")
>>> trainer = Trainer(nn.Dense(2), loss="sparse_categorical_crossentropy",
...                   optimizer=optax.adam(0.1), metrics=["accuracy"], strategy="single")
>>> history = trainer.fit((x, y), epochs=3, batch_size=16, verbose=0)
>>> len(history.history["loss"]), trainer.evaluate((x, y))["accuracy"] > 0.8
(3, True)
>>> trainer.predict(x[:5]).shape
(5, 2)
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import sys
import warnings
from typing import Any, Iterable, Sequence

import jax
import numpy as np
import optax

from trainkit import checkpoint as checkpoint_lib, distributed
from trainkit import data as data_lib
from trainkit import losses, metrics as metrics_lib, plan as plan_lib
from trainkit.callbacks import Callback, CallbackList, History, ProgressBar, TerminateOnNaN
from trainkit.model import NNXModel, adapt_model
from trainkit.precision import Precision, cast_floating, get_precision
from trainkit.remat import wrap_remat
from trainkit.state import Batch, TrainState
from trainkit.version import __version__
from trainkit.step import make_eval_step, make_predict_step, make_train_step
from trainkit.strategies import Auto, DataParallel, Strategy, resolve_strategy

PyTree = Any
logger = logging.getLogger("trainkit")

#: Exit code of a run stopped by SIGTERM (preemption) after writing its backup: 128 + SIGTERM.
PREEMPTED_EXIT_CODE = 143


def _host_float64(metrics: dict) -> dict:
    host = distributed.fetch(metrics)
    return jax.tree.map(lambda v: np.float64(v), host)


class Trainer:
    """Trains a Flax module with a loss and an optax optimizer on any strategy.

    Args:
        model: a ``flax.linen.Module`` or ``flax.nnx.Module``. A ``train``, ``training`` or
            ``deterministic`` argument of its ``__call__`` is set by the Trainer.
        loss: a name (``"sparse_categorical_crossentropy"``, ``"categorical_crossentropy"``,
            ``"binary_crossentropy"``, ``"mse"``, ``"mae"``; cross-entropies take logits) or a
            callable ``loss(predictions, targets)`` returning per-example values or a mean.
        optimizer: any ``optax.GradientTransformation``.
        metrics: names (``"accuracy"``, ``"top_k_accuracy"``, ...) or callables
            ``metric(predictions, targets)``.
        strategy: a :class:`trainkit.Strategy`, ``"auto"`` (the default) or a name.
        seed: seeds initialisation, dropout and the shuffle order.
        params: variables to start from (``{"params": ..., "batch_stats": ...}`` or just the
            parameter tree), for fine-tuning.
        precision: ``"fp32"`` (default), ``"bf16"``, ``"fp16"`` (mixed, dynamic loss
            scaling) or a :class:`trainkit.Precision`.
        remat: ``None``, ``"full"``, ``"dots"``, ``"dots_no_batch"``, a ``jax.checkpoint``
            policy, or a list of Flax submodule class names to rematerialise (see
            :mod:`trainkit.remat`).
        grad_accum_steps: split each global batch into this many micro-batches inside one
            compiled step; the update equals the whole batch's.
        log_grad_norm: log the global gradient norm of every step (``grad_norm``); it costs
            one more pass over the gradients (free when the optimizer clips by global norm).

    Override :meth:`compute_loss` to train a model whose loss is not ``loss(preds, y)``.
    """

    #: Steps dispatched ahead of the oldest one whose metrics were not read yet. Bounded: too
    #: many queued collectives deadlock XLA's CPU all-reduce on fake devices.
    max_in_flight: int = 2

    def __init__(
        self,
        model: Any,
        *,
        loss: str | losses.LossFn | None = None,
        optimizer: optax.GradientTransformation,
        metrics: Sequence[str | metrics_lib.MetricFn] | None = None,
        strategy: str | Strategy = "auto",
        seed: int = 0,
        params: PyTree | None = None,
        precision: str | Precision | None = "fp32",
        remat: Any = None,
        grad_accum_steps: int = 1,
        log_grad_norm: bool = True,
    ):
        distributed.initialize_from_environment()  # a multi-process job: connect first
        self.model = model
        self._adapter = adapt_model(model)
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(
                f"optimizer must be an optax.GradientTransformation such as optax.adam(1e-3); "
                f"received {type(optimizer).__name__}."
            )
        if loss is None and type(self).compute_loss is Trainer.compute_loss:
            raise ValueError("Pass loss=..., or subclass Trainer and override compute_loss.")
        self.loss = loss
        self._loss_fn = None if loss is None else losses.get_loss(loss)
        self._row_loss = None if loss is None else losses.per_example(self._loss_fn)
        self.optimizer = optimizer
        self.metric_fns = metrics_lib.get_metrics(metrics)
        self._log_order = ("loss", *self.metric_fns)
        self.strategy = resolve_strategy(strategy)
        self.seed = int(seed)
        self._initial_variables = params
        self.precision = get_precision(precision)
        if not isinstance(grad_accum_steps, (int, np.integer)) or grad_accum_steps < 1:
            raise ValueError(
                f"grad_accum_steps must be a positive integer; received {grad_accum_steps!r}."
            )
        self.grad_accum_steps = int(grad_accum_steps)
        self.log_grad_norm = bool(log_grad_norm)
        self.remat = remat
        self._apply = self.precision.wrap_apply(wrap_remat(self._adapter, remat))
        self.state: TrainState | None = None
        self.input_spec: PyTree | None = None
        self._compiled: dict[str, Any] = {}
        self.stop_training = False
        self.global_step = 0  # optimizer steps dispatched
        self.reported_step = 0  # the step whose metrics on_train_batch_end reports (1-based)
        self.epoch = 0
        self.epochs: int | None = None
        self.steps_per_epoch: int | None = None
        self.history: History | None = None
        self.position = {"epoch": 0, "batch": 0}  # the next batch to train on
        self.batch_size: int | None = None
        self.preempted = False  # set by BackupAndRestore on SIGTERM
        self.resume_position: dict | None = None
        self.last_plan: plan_lib.MemoryPlan | None = None  # the plan strategy="auto" chose from
        self._batch_abstract: PyTree = None  # the shape of fit's batches, for lowered_text()

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
        row (a scalar is taken as the mean over the rows). Override it in a subclass for
        losses that are not ``loss(predictions, y)``; the function must stay pure.
        """
        predictions, model_state = self.apply(params, model_state, batch["x"], rng=rng, train=train)
        return self._row_loss(predictions, batch["y"]), (predictions, model_state)

    @property
    def _custom_loss(self) -> bool:
        return type(self).compute_loss is not Trainer.compute_loss

    # ------------------------------------------------------------------ state
    def init(self, sample_batch: Any) -> TrainState:
        """Builds the state from a sample batch (``x``, ``(x, y)`` or a dataset dict) without
        training. Idempotent: a second call keeps the existing state."""
        x, _, _ = data_lib.split_xyw(sample_batch)
        spec = data_lib.example_spec(x)
        if self.state is not None:
            data_lib.check_same_inputs(self.input_spec, spec)
            return self.state
        self._resolve_auto(sample_batch, None)
        first_row = jax.tree.map(lambda a: np.asarray(a[:1]), x)
        variables = self._starting_variables(first_row)
        self.state = self.strategy.create_state(self._init_state, variables, first_row)
        self.input_spec = spec
        self.global_step = int(self.state.step)
        return self.state

    def _init_state(self, variables, first_row) -> TrainState:
        init_rng, state_rng = jax.random.split(jax.random.PRNGKey(self.seed))
        if variables is None:
            params, model_state = self._adapter.init(init_rng, first_row)
        else:
            params, model_state = variables
        params = cast_floating(params, self.precision.param_dtype)
        return TrainState.create(
            params=params,
            opt_state=self.optimizer.init(params),
            model_state=model_state,
            seed=state_rng,
        ).replace(loss_scale=self.precision.init_loss_scale())

    def _starting_variables(self, first_row):
        """Given variables (checked against the model's own) or the NNX module's arrays."""
        given = self._initial_variables
        if given is None:
            if isinstance(self._adapter, NNXModel):
                return self._adapter.init(None, None)
            return None
        abstract = jax.eval_shape(self._adapter.init, jax.random.PRNGKey(0), first_row)
        if isinstance(given, dict) and "params" in given:
            variables = (given["params"], {k: v for k, v in given.items() if k != "params"})
        else:
            variables = (given, {})
        _check_tree_matches("params=", abstract, variables)
        return jax.tree.map(np.asarray, variables)

    def _require_state(self) -> TrainState:
        if self.state is None:
            raise RuntimeError(
                "The trainer has no state yet: call fit(...) or init(sample_batch) first."
            )
        return self.state

    @property
    def params(self) -> PyTree:
        """The parameters as host NumPy arrays."""
        return jax.tree.map(np.asarray, distributed.fetch(self._require_state().params))

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
        _check_tree_matches("set_weights", (state.params, state.model_state), (params, variables))
        shardings = jax.tree.map(lambda a: a.sharding, (state.params, state.model_state))
        placed = jax.device_put((params, variables), shardings)
        self.state = state.replace(params=placed[0], model_state=placed[1])

    # ------------------------------------------------------------------ checkpoints
    def manifest(self) -> dict:
        """What a checkpoint records besides the arrays (JSON; see docs/checkpointing.md)."""
        state = self._require_state()
        mesh = self.strategy.mesh
        return {
            "trainkit_version": __version__,
            "jax_version": jax.__version__,
            "strategy": type(self.strategy).__name__,
            "strategy_description": self.strategy.describe(),
            "mesh": {name: int(size) for name, size in mesh.shape.items()},
            "device_count": len(self.strategy.devices),
            "process_count": jax.process_count(),
            "precision": str(self.precision.compute_dtype),
            "seed": self.seed,
            "batch_size": self.batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "position": dict(self.position, global_step=int(self.global_step)),
            "tree": {
                "params": checkpoint_lib.tree_signature(state.params),
                "opt_state": checkpoint_lib.tree_signature(state.opt_state),
                "model_state": checkpoint_lib.tree_signature(state.model_state),
            },
        }

    def save(self, directory: str | os.PathLike, *, max_to_keep: int | None = None) -> int:
        """Writes the full state and manifest to ``directory`` (an orbax checkpoint at the
        current step) and waits until it is on disk. Returns the step."""
        checkpointer = checkpoint_lib.Checkpointer(directory, max_to_keep=max_to_keep, enable_async=False)
        try:
            checkpointer.save(self.global_step, self._require_state(), self.manifest(), wait=True)
        finally:
            checkpointer.close()
        return self.global_step

    def load(self, directory: str | os.PathLike | checkpoint_lib.Checkpointer, step: int | None = None) -> dict:
        """Restores the full state (the latest checkpoint, or ``step``) into this trainer's
        strategy and shardings; the checkpoint may come from another strategy or device
        count. Call ``init(sample_batch)`` first. Returns the checkpoint's manifest."""
        if self.state is None:
            raise RuntimeError(
                "load() restores into the trainer's state: call init(sample_batch) (or fit) first, "
                "so that the model's shapes are known."
            )
        own = not isinstance(directory, checkpoint_lib.Checkpointer)
        checkpointer = checkpoint_lib.Checkpointer(directory) if own else directory
        try:
            self.state, manifest = checkpointer.restore(self.state, step)
        finally:
            if own:
                checkpointer.close()
        self.global_step = int(self.state.step)
        self._explain_restore(manifest)
        return manifest

    def _explain_restore(self, manifest: dict) -> None:
        devices, batch = len(self.strategy.devices), getattr(self, "batch_size", None)
        if manifest.get("device_count") != devices or manifest.get("strategy") != type(self.strategy).__name__:
            logger.warning(
                "Restored step %s written by %s on %s devices into %s on %s devices: the state is "
                "exact; later steps reduce over another device layout, so they match the "
                "original run to float rounding, not bit for bit.",
                manifest["position"]["global_step"], manifest.get("strategy"), manifest.get("device_count"),
                type(self.strategy).__name__, devices,
            )
        if batch is not None and manifest.get("batch_size") not in (None, batch):
            logger.warning(
                "The checkpoint was written with batch_size=%s, this run uses %s: the data "
                "position is converted by examples seen (batch %s -> %s), and the batches, and "
                "so the updates, differ from the original run from here on.",
                manifest["batch_size"], batch, manifest["position"]["batch"],
                self.position_after(manifest)["batch"],
            )

    def position_after(self, manifest: dict) -> dict:
        """Where to continue after restoring ``manifest``'s checkpoint: its ``epoch`` and
        ``batch``, the batch converted by examples seen if the batch size changed."""
        position = dict(manifest["position"])
        saved, now = manifest.get("batch_size"), self.batch_size
        if saved and now:
            position["batch"] = position["batch"] * saved // now
        return position

    # ------------------------------------------------------------------ compiled steps
    def _step_fn(self, kind: str, strategy: Strategy):
        axis = strategy.axis_name
        if kind == "train":
            return make_train_step(self.compute_loss, self.optimizer, self.metric_fns, axis,
                                   grad_accum_steps=self.grad_accum_steps, log_grad_norm=self.log_grad_norm)
        if kind == "eval":
            return make_eval_step(self.compute_loss, self.metric_fns, axis)
        return make_predict_step(self.apply)

    def _compile(self, kind: str, strategy: Strategy, abstract_state: PyTree):
        compile_fn = {"train": strategy.compile_train, "eval": strategy.compile_eval,
                      "predict": strategy.compile_predict}[kind]
        return compile_fn(self._step_fn(kind, strategy), abstract_state)

    def _function(self, kind: str):
        if kind not in self._compiled:
            self._compiled[kind] = self._compile(kind, self.strategy, _abstract(self._require_state()))
        return self._compiled[kind]

    def lowered_text(self, sample_batch: Any = None) -> str:
        """The train step as StableHLO text, before compiler optimisation (what the removed
        ``jax.xla_computation`` showed). ``sample_batch`` defaults to the last ``fit``'s batch
        shape."""
        return self._lower_train(sample_batch).as_text()

    def compiled_text(self, sample_batch: Any = None) -> str:
        """The train step as optimised HLO after partitioning: the collectives the compiler
        inserted (``all-gather``, ``reduce-scatter``, ``all-reduce``) are visible here."""
        return self._lower_train(sample_batch).compile().as_text()

    def _lower_train(self, sample_batch):
        state = self._require_state()
        if sample_batch is not None:
            x, y, w = data_lib.split_xyw(sample_batch)
            batch = self.strategy.put_batch(data_lib.pad_batch(x, y, w, data_lib.num_rows(x)))
        elif self._batch_abstract is not None:
            batch = self._batch_abstract
        else:
            raise ValueError("Pass a sample batch, e.g. trainer.lowered_text((x[:32], y[:32])), or call fit first.")
        function = self._function("train")
        if not hasattr(function, "lower"):
            raise TypeError(f"{type(self.strategy).__name__}.compile_train returned a function without .lower().")
        return function.lower(_abstract(state), batch)

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
        the argument / output / temporary / total bytes, the flops, bytes accessed and bytes
        moved by collectives, and an estimated (or with ``measure=True`` measured) step time.

        ``sample_batch`` is a batch in any form ``fit`` takes; ``batch_size`` (default: its
        rows) is the global batch size to plan for. Nothing is allocated unless ``measure``.
        ``verbose=1`` prints the table; the recommended row is what ``strategy="auto"`` picks.
        """
        dataset = data_lib.as_dataset(sample_batch)
        if batch_size is None:
            batch_size = data_lib.num_rows(dataset.first(sys.maxsize)[0])
        x, y, w = dataset.first(batch_size)
        if y is None and not self._custom_loss:
            raise ValueError("plan() compiles the train step, so the sample batch needs targets: pass (x, y).")
        host_batch = data_lib.pad_batch(x, y, w, batch_size)
        first_row = jax.tree.map(lambda a: np.asarray(a[:1]), host_batch["x"])
        if jax.process_count() > 1:  # strategies place this process's part of a global batch
            local, index = batch_size // jax.process_count(), jax.process_index()
            host_batch = jax.tree.map(lambda a: a[index * local:(index + 1) * local], host_batch)
        variables = self._starting_variables(first_row)
        abstract_state = jax.eval_shape(self._init_state, variables, first_row)
        functions = {}  # the jitted step per candidate, kept on its row for reuse

        def lower(strategy: Strategy):
            data_lib.check_batch_size(batch_size, strategy.num_batch_shards, micro_batches=self.grad_accum_steps)
            shardings = strategy.state_sharding(abstract_state)
            abstract = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings
            )
            function = functions[id(strategy)] = self._compile("train", strategy, abstract)
            return function.lower(abstract, strategy.put_batch(host_batch))

        host_state = []  # initialised once (sharded, by the first candidate), then copied

        def run(strategy: Strategy, compiled) -> float:
            if not host_state:
                host_state.append(distributed.fetch(strategy.create_state(self._init_state, variables, first_row)))
            state = strategy.put_state(host_state[0])
            return plan_lib.time_steps(compiled, state, strategy.put_batch(host_batch), steps)

        result = plan_lib.make_plan(
            candidates if candidates is not None else plan_lib.default_candidates(),
            lower, memory_limit=memory_limit, measure=run if measure else None,
        )
        for row in result.rows:
            row.function = functions.get(id(row.strategy))
        if verbose:
            result.print()
        return result

    def _resolve_auto(self, sample_batch: Any, batch_size: int | None, announce: bool = False) -> None:
        """Replaces an :class:`~trainkit.strategies.Auto` strategy with its plan's choice."""
        auto = self.strategy
        if not isinstance(auto, Auto):
            return
        if not data_lib.as_dataset(sample_batch).has_targets and not self._custom_loss:
            self.strategy = DataParallel()
            logger.info("strategy='auto' without targets to compile the train step with: using %s. "
                        "Call fit, or init((x, y)), to choose from the compiled plan.", self.strategy.describe())
            return
        result = self.plan(sample_batch, batch_size=batch_size, candidates=auto.candidates,
                           measure=auto.measure, memory_limit=auto.memory_limit, verbose=0)
        best = result.recommended
        if best is None:
            raise ValueError(
                f"strategy='auto' found no strategy that runs this model and batch: {result.reason()}. "
                "Lower the batch size, pass remat='full' or grad_accum_steps=k, or pass "
                f"strategy=tk.strategies.Auto(memory_limit=...) or a strategy.\n{result}"
            )
        self.strategy = best.strategy
        self.last_plan = result
        if best.function is not None:  # compiled during the plan: not compiled again
            self._compiled["train"] = best.function
        logger.info("strategy='auto' %s", result.reason())
        if announce and distributed.is_main_process():
            print(f"strategy='auto' {result.reason()}")

    # ------------------------------------------------------------------ input checks
    def _prepare(self, data, y, sample_weight, batch_size, *, targets: bool, training: bool = False,
                 announce: bool = False, config: dict | None = None):
        dataset = data_lib.as_dataset(data, y, sample_weight)
        if targets and not dataset.has_targets and not self._custom_loss:
            raise ValueError(
                "The data has no targets: pass (x, y), {'x': ..., 'y': ...} or x and y as two "
                "arguments (or override compute_loss for a loss without targets)."
            )
        if isinstance(dataset, data_lib.IterableDataset):
            if batch_size is not None and batch_size != dataset.batch_size:
                raise ValueError(
                    f"batch_size={batch_size} was given, but the iterable yields batches of "
                    f"{dataset.batch_size} rows; an iterable's batches set the batch size. "
                    "Drop batch_size, or re-batch the iterable."
                )
            batch_size = dataset.batch_size * jax.process_count()  # each process yields its part
        else:
            batch_size = 32 if batch_size is None else batch_size
        data_lib.check_batch_size(batch_size, self.strategy.num_batch_shards,
                                  micro_batches=self.grad_accum_steps if training else 1)
        distributed.check_same_configuration({  # before anything that needs the processes to agree
            "batch_size": batch_size, "seed": self.seed, "strategy": self.strategy.describe(),
            "grad_accum_steps": self.grad_accum_steps, "precision": str(self.precision.compute_dtype),
            "inputs": str(dataset.element_spec()), **(config or {}),
        })
        x0, y0, _ = dataset.first()
        if targets and self._loss_fn is not None:
            losses.check_targets(self._loss_fn, y0)
        if self.state is None:
            if isinstance(self.strategy, Auto):
                first_x, first_y, _ = dataset.first(batch_size)
                sample = first_x if first_y is None else (first_x, first_y)
                self._resolve_auto(sample, batch_size, announce)
            self.init(x0)
        else:
            data_lib.check_same_inputs(self.input_spec, dataset.element_spec())
        return dataset, batch_size

    # ------------------------------------------------------------------ fit
    def fit(
        self,
        data: Any,
        y: PyTree = None,
        *,
        epochs: int = 1,
        batch_size: int | None = None,
        validation_data: Any = None,
        validation_batch_size: int | None = None,
        shuffle: bool = True,
        sample_weight: PyTree = None,
        steps_per_epoch: int | None = None,
        max_steps: int | None = None,
        initial_epoch: int = 0,
        callbacks: Iterable[Callback] = (),
        verbose: int = 1,
    ) -> History:
        """Trains for ``epochs`` epochs (or ``max_steps`` optimizer steps) and returns a Keras
        ``History``. See the class docstring for the accepted data forms."""
        if not isinstance(epochs, (int, np.integer)) or epochs < 1:
            raise ValueError(f"epochs must be a positive integer; received epochs={epochs!r}.")
        for name, value in (("steps_per_epoch", steps_per_epoch), ("max_steps", max_steps)):
            if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None; received {value!r}.")
        dataset, batch_size = self._prepare(
            data, y, sample_weight, batch_size, targets=True, training=True, announce=bool(verbose),
            config={"epochs": epochs, "shuffle": shuffle, "steps_per_epoch": steps_per_epoch,
                    "max_steps": max_steps, "initial_epoch": initial_epoch},
        )
        validation = None
        if validation_data is not None:
            validation = self._prepare(
                validation_data, None, None, validation_batch_size or batch_size, targets=True
            )
        steps = dataset.steps(batch_size)
        if steps_per_epoch is not None:
            steps = steps_per_epoch if steps is None else min(steps, steps_per_epoch)
        if steps is None and not isinstance(dataset, data_lib.ArrayDataset) and dataset.one_shot and epochs > 1:
            raise ValueError(
                "A one-shot iterator (such as a generator) cannot be restarted, so with "
                "epochs > 1 pass steps_per_epoch=N to say where an epoch ends."
            )
        self.epochs, self.steps_per_epoch = epochs, steps
        self.history = History()
        callbacks = list(callbacks)
        if verbose and distributed.is_main_process() and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(ProgressBar(verbose))
        callback_list = CallbackList([self.history, *callbacks], trainer=self)
        self.history.params = {"epochs": epochs, "steps": steps, "verbose": verbose}
        self.stop_training = False
        train_fn = self._function("train")
        logger.info("fit: %s, batch_size=%d, %s steps/epoch", self.strategy.describe(), batch_size, steps)

        self.preempted = False
        self.resume_position = None
        self.batch_size = batch_size
        callback_list.on_train_begin()  # BackupAndRestore may restore a run here
        start_epoch, start_batch = initial_epoch, 0
        if self.resume_position is not None:
            start_epoch, start_batch = self.resume_position["epoch"], self.resume_position["batch"]
        logs: dict[str, float] = {}
        for epoch in range(start_epoch, epochs):
            self.epoch = epoch
            first = start_batch if epoch == start_epoch else 0
            self.position = {"epoch": epoch, "batch": first}
            callback_list.on_epoch_begin(epoch)
            batches = dataset.batches(batch_size, shuffle=shuffle, seed=self.seed, epoch=epoch, start=first,
                                      **_process_slice())
            limit = None if steps is None else max(steps - first, 0)
            ran, logs = self._train_epoch(
                train_fn, itertools.islice(batches, limit), callback_list, max_steps, first
            )
            if self.preempted:
                break
            if ran == 0 and first == 0:
                warnings.warn(
                    f"The data ran out at epoch {epoch}: no batch was left. Training stops; "
                    "pass steps_per_epoch that the data can serve, or a re-iterable dataset.",
                    stacklevel=2,
                )
                break
            if validation is not None:
                val_logs = self._evaluate(*validation, None, callback_list)
                logs.update({f"val_{k}": v for k, v in val_logs.items()})
            self.position = {"epoch": epoch + 1, "batch": 0}
            callback_list.on_epoch_end(epoch, logs)
            if self.stop_training or (max_steps is not None and self.global_step >= max_steps):
                break
        callback_list.on_train_end(logs)
        if self.preempted:
            raise SystemExit(PREEMPTED_EXIT_CODE)
        return self.history

    def _train_epoch(self, train_fn, batches, callback_list, max_steps, first) -> tuple[int, dict]:
        batch_begin = callback_list.on_train_batch_begin
        batch_end = callback_list.on_train_batch_end

        def dispatch():
            for index, host_batch in enumerate(batches, start=first):
                if batch_begin.active:
                    batch_begin(index)
                batch = self.strategy.put_batch(host_batch)
                if self._batch_abstract is None:
                    self._batch_abstract = _abstract(batch)
                self.state, metrics = train_fn(self.state, batch)
                self.global_step += 1
                self.position = {"epoch": self.epoch, "batch": index + 1}
                yield index, self.global_step, metrics
                if self.stop_training or (max_steps is not None and self.global_step >= max_steps):
                    return

        warn_non_finite = self.precision.loss_scale is None and not any(
            isinstance(c, TerminateOnNaN) for c in callback_list.callbacks
        )
        totals, ran = None, 0
        for index, self.reported_step, metrics in self._bounded(dispatch()):
            metrics = _host_float64(metrics)
            if warn_non_finite and not np.isfinite(metrics["loss"].total):
                warn_non_finite = False  # once per epoch
                warnings.warn(
                    f"The loss is {metrics['loss'].total / metrics['loss'].count} at step "
                    f"{self.reported_step} (batch {index} of epoch {self.epoch}); training goes "
                    "on. Add tk.callbacks.TerminateOnNaN() to stop at the first non-finite loss.",
                    stacklevel=3,
                )
            totals = metrics_lib.merge(totals, metrics)
            ran += 1
            if batch_end.active:
                batch_end(index, metrics_lib.compute(totals, self._log_order))
        return ran, ({} if totals is None else metrics_lib.compute(totals, self._log_order))

    # ------------------------------------------------------------------ evaluate / predict
    def evaluate(
        self,
        data: Any,
        y: PyTree = None,
        *,
        batch_size: int | None = None,
        sample_weight: PyTree = None,
        steps: int | None = None,
        callbacks: Iterable[Callback] = (),
        verbose: int = 0,
    ) -> dict[str, float]:
        """The loss and metrics over the whole dataset, exact for any device count:
        ``{"loss": float, "accuracy": float, ...}``. ``verbose`` is accepted for Keras
        compatibility; evaluation prints nothing."""
        dataset, batch_size = self._prepare(data, y, sample_weight, batch_size, targets=True)
        return self._evaluate(dataset, batch_size, steps, CallbackList(callbacks, trainer=self))

    def _evaluate(self, dataset, batch_size, steps, callback_list) -> dict[str, float]:
        eval_fn = self._function("eval")
        callback_list.on_test_begin()
        totals = None
        for metrics in self._bounded(
            eval_fn(self.state, self.strategy.put_batch(batch))
            for batch in itertools.islice(dataset.batches(batch_size, **_process_slice()), steps)
        ):
            totals = metrics_lib.merge(totals, _host_float64(metrics))
        logs = metrics_lib.compute(totals, self._log_order)
        callback_list.on_test_end(logs)
        return logs

    def predict(
        self,
        x: Any,
        *,
        batch_size: int | None = None,
        steps: int | None = None,
        callbacks: Iterable[Callback] = (),
        verbose: int = 0,
    ) -> PyTree:
        """Model outputs with exactly one row per input row (padding removed): an array, or a
        pytree of arrays for models with several outputs. ``x`` takes the forms ``fit``
        takes (targets, if present, are ignored); ``verbose`` is accepted for Keras
        compatibility."""
        dataset, batch_size = self._prepare(x, None, None, batch_size, targets=False)
        predict_fn = self._function("predict")
        callback_list = CallbackList(callbacks, trainer=self)
        callback_list.on_predict_begin()
        parts = []
        batches = itertools.islice(dataset.batches(batch_size, **_process_slice()), steps)
        rows_iter = (
            (predict_fn(self.state, self.strategy.put_batch(b)), self._global_rows(b["mask"]))
            for b in batches
        )
        for outputs, rows in self._bounded(rows_iter):
            host = self.strategy.fetch_rows(outputs)
            parts.append(jax.tree.map(lambda a: a[:rows], host))
        result = jax.tree.map(lambda *a: np.concatenate(a), *parts)
        callback_list.on_predict_end()
        return result

    @staticmethod
    def _global_rows(local_mask: np.ndarray) -> int:
        """Real rows of the global batch (they come first; padding follows)."""
        if jax.process_count() == 1:
            return int(local_mask.sum())
        from jax.experimental import multihost_utils

        return int(np.asarray(multihost_utils.process_allgather(np.asarray(local_mask.sum()))).sum())

    def _bounded(self, dispatched):
        """Yields device results in order while keeping at most ``max_in_flight`` pending."""
        pending: collections.deque = collections.deque()
        for item in dispatched:
            pending.append(item)
            if len(pending) > self.max_in_flight:
                yield pending.popleft()
        yield from pending


def _process_slice() -> dict:
    """Which part of every global batch this process reads (all of it on one process)."""
    return {"process_index": jax.process_index(), "process_count": jax.process_count()}


def _abstract(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _check_tree_matches(what: str, expected: PyTree, received: PyTree) -> None:
    """Raises naming every path whose presence or shape differs."""
    shape = lambda t: {  # noqa: E731
        jax.tree_util.keystr(p): tuple(np.shape(v)) for p, v in jax.tree_util.tree_leaves_with_path(t)
    }
    exp, got = shape(expected), shape(received)
    problems = [f"missing {k} {v}" for k, v in exp.items() if k not in got]
    problems += [f"unexpected {k} {v}" for k, v in got.items() if k not in exp]
    problems += [f"{k}: expected shape {v}, received {got[k]}" for k, v in exp.items() if k in got and got[k] != v]
    if problems:
        raise ValueError(
            f"{what} does not match the model's variables: " + "; ".join(problems[:10])
            + (f" (and {len(problems) - 10} more)" if len(problems) > 10 else "")
            + ". Pass variables created by the same model (e.g. from trainer.get_weights())."
        )
