"""``Trainer``: Keras's ``fit`` / ``evaluate`` / ``predict`` in, delegation out (``Loop``, ``Setup``, checkpoint).

>>> import numpy as np, optax, flax.linen as nn
>>> x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
>>> y = (x.sum(axis=1) > 0).astype("int32")
>>> trainer = Trainer(nn.Dense(2), loss="sparse_categorical_crossentropy",
...                   optimizer=optax.adam(0.1), metrics=["accuracy"], strategy="single")
>>> history = trainer.fit((x, y), epochs=3, batch_size=16, verbose=0)
>>> loss, accuracy = trainer.evaluate((x, y))   # as Keras; return_dict=True gives a dict
>>> len(history.history["loss"]), accuracy > 0.8, trainer.predict(x[:5]).shape
(3, True, (5, 2))
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Unpack, cast

import jax
import optax
from rich.console import Console

from trainkit import checkpoint as checkpoint_lib
from trainkit import distributed
from trainkit import export as export_lib
from trainkit import weights as weights_lib
from trainkit.callbacks import Callback, CallbackList, History, lr_finder
from trainkit.core import loss_call, override_step, watched_batch
from trainkit.core.local_path import LocalPath
from trainkit.core.model import Model
from trainkit.core.state import Batch, TrainState
from trainkit.core.tree import PyTree, TreeFunction
from trainkit.data import DataInput
from trainkit.loop import Loop
from trainkit.monitoring import debug
from trainkit.monitoring import summary as summary_lib
from trainkit.objective import LossSpec, MetricSpec
from trainkit.planning import plan as plan_lib
from trainkit.planning.batch_size import BatchSizeSearch
from trainkit.program import inputs, tuning
from trainkit.program.arguments import FitArguments, FitOptions, TrainerArguments, TrainerOptions
from trainkit.program.state_access import GroupRates
from trainkit.record.session import Session
from trainkit.strategies import Auto, Strategy


class Trainer:
    """Trains a Flax module with a loss and an optax optimizer on any strategy.

    Args:
        model: a ``flax.linen.Module`` or ``flax.nnx.Module`` (``train`` / ``deterministic`` set for you).
        loss, metrics, weighted_metrics, loss_weights, run_eagerly, jit_compile, steps_per_execution: as Keras 3's
            ``compile`` takes them (also ``loss(predictions, targets)``), but cross-entropies by name take logits,
            and ``steps_per_execution="auto"`` (a fused call where nothing observable changes) is the default.
        optimizer: any ``optax.GradientTransformation``, or one per sub-network by path regex
            (``{"generator": ..., "discriminator": ...}``, ``re.match``; docs/custom_training.md).
        strategy: a :class:`trainkit.Strategy`, a name, or ``"auto"`` (picked by the compiled plan).
        seed: seeds initialisation, dropout and the shuffle order. params: variables to start from (fine-tuning).
        **options: trainkit's own beyond Keras's compile, each described in ``TrainerOptions`` (program/arguments.py;
            an unknown name is refused): precision, remat, grad_accum_steps, log_grad_norm, mixes_rows, deterministic,
            trainable, lora, skip_spikes, frozen_statistics, offload, step (a tk.Step).

    Override :meth:`compute_loss` (a loss not ``loss(predictions, y)``) or :meth:`train_step` (docs/custom_training.md);
    each argument: docs/quickstart.md, docs/outputs.md, docs/performance.md, docs/precision_and_memory.md.
    """

    def __init__(
        self,
        model: Model,
        *,
        loss: LossSpec = None,
        optimizer: optax.GradientTransformation | dict[str, optax.GradientTransformation],
        metrics: MetricSpec = None,
        weighted_metrics: MetricSpec = None,
        loss_weights: float | Sequence[float] | Mapping[str, float] | None = None,
        strategy: str | Strategy | Auto = "auto",
        seed: int = 0,
        params: PyTree | None = None,
        steps_per_execution: int | str | None = None,
        run_eagerly: bool = False,
        jit_compile: bool | str = "auto",
        **options: Unpack[TrainerOptions],
    ) -> None:
        given = TrainerArguments.of(locals())  # one value: handed on, and what merge_lora rebuilds from
        given.connect()  # XLA's flags and a multi-process job, before anything touches the devices
        own = override_step.overrides(type(self), Trainer, has_loss=loss is not None, step=given.step)  # compute_loss..
        self.arguments = given.checked(own)
        self.model, self.loss, self.optimizer, self.seed = model, loss, optimizer, int(seed)
        self.objective, step = given.objective(own), override_step.step_of(self, own, given.step)
        self.program = given.program(self.objective, compute_loss=self.compute_loss, apply=self.apply, step=step)
        self.precision, self.grad_accum_steps = self.program.precision, self.program.grad_accum_steps
        self.run_eagerly = self.program.eager
        self.session = Session()  # the one holder of the live state, the position and the flags
        self.setup = given.setup(self.program, self.session, own)
        self.state_access, self.compiled = self.setup.state_access, self.setup.compiled
        self.loop = Loop(self.session, self.compiled)

    def apply(
        self, params: PyTree, model_state: PyTree, x: PyTree, *, rng: jax.Array, train: bool, method: str | None = None
    ) -> tuple[PyTree, PyTree]:
        """``(outputs, new_model_state)`` of the model (or its ``method``) under precision and remat; pure."""
        return self.program.steps.call_model(params, model_state, x, rng=rng, train=train, method=method)

    def compute_loss(
        self, params: PyTree, batch: Batch, rng: jax.Array, *, model_state: PyTree, train: bool
    ) -> tuple[jax.Array, tuple[PyTree, PyTree]]:
        """A batch's (``"x"``, ``"y"``, ``"mask"``, maybe ``"sample_weight"``: per token, applied here)
        ``(per_example_loss, (predictions, new_model_state))``, one loss per row (never a mean). Pure."""
        predictions, model_state = self.apply(params, model_state, batch["x"], rng=rng, train=train)
        return self.objective.loss(predictions, batch["y"], watched_batch.per_token(batch)), (predictions, model_state)

    def train_step(self, state: TrainState, batch: Batch, rng: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        """Override for a step of your own (or pass ``step=``): pure, ``(state, batch, rng) -> (state, logs)``, helpers
        on the state; run by every strategy, fused and resumed as the built-in step (docs/custom_training.md)."""
        raise override_step.not_callable("train_step")

    def test_step(self, state: TrainState, batch: Batch, rng: jax.Array) -> dict[str, jax.Array]:
        """Override for an evaluation of your own: pure, ``(state, batch, rng) -> logs`` (default: the loss)."""
        raise override_step.not_callable("test_step")

    @property
    def step(self) -> override_step.Step | None:
        """The step value (``step=``'s, a ``train_step`` override's; ``None``: built in); settable between fits."""
        return self.program.steps.own.value

    @step.setter
    def step(self, value: override_step.Step) -> None:
        self.program.steps.own.replace(value)

    @property
    def state(self) -> TrainState | None:
        """The live TrainState (None before fit or init)."""
        return loss_call.outside_a_step(self.session.state)

    @property
    def strategy(self) -> Strategy | None:
        """The strategy (under "auto": None until planned)."""
        return self.setup.decided.strategy

    @property
    def last_plan(self) -> plan_lib.MemoryPlan | None:
        """The plan strategy="auto" chose from."""
        return self.setup.decided.last_plan

    @property
    def steps_per_execution(self) -> int:
        """Batches per compiled training call."""
        return self.setup.decided.steps_per_execution

    @property
    def global_step(self) -> int:
        """Optimizer steps applied (dispatched) so far."""
        return self.session.position.step

    @property
    def history(self) -> History | None:
        """The History the last fit returned (None before; the session, in record/, holds it untyped)."""
        return cast("History | None", self.session.history)

    @property
    def stop_training(self) -> bool:
        """Keras's flag: True stops before the next batch."""
        return self.session.stop_requested

    @stop_training.setter
    def stop_training(self, value: bool) -> None:
        self.session.set_stop_requested(value)

    @property
    def learning_rate(self) -> float | GroupRates:
        """The (inject_hyperparams) learning rate; settable (under an optimizer per group: each by name)."""
        return self.state_access.learning_rate

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        self.state_access.set_learning_rate(value)

    def compile(self, *args: object, **kwargs: object) -> None:  # Keras's habit: the loss and optimizer come when made
        raise TypeError("A Trainer is compiled when made: tk.Trainer(model, loss=..., optimizer=..., metrics=[...]).")

    def update_state(self, **fields: PyTree) -> TrainState:
        """The one way to write the live state: fields placed in the shardings of those they replace."""
        return self.state_access.update_state(**fields)

    def init(self, sample_batch: DataInput) -> TrainState:
        """The state from a sample batch (as ``fit`` takes), the strategy chosen first under ``"auto"``."""
        return self.setup.init(sample_batch)

    @property
    def params(self) -> PyTree:
        """Host NumPy copies of the parameters."""
        return self.state_access.host_params

    def count_params(self) -> int:
        """The number of scalars in all variables (parameters and model state), as Keras counts."""
        return self.state_access.count_params()

    def summary(self, sample: DataInput = None, console: Console | None = None) -> None:
        """Keras's ``summary()``: modules, output shapes, parameters, step FLOPs; a ``sample`` initialises first."""
        (console or Console()).print(summary_lib.summary_view(self, self.setup.summary_inputs(sample)))

    def get_weights(self) -> PyTree:
        """Host copies of all variables: ``{"params": ..., **model_state}``."""
        return self.state_access.weights()

    def set_weights(self, variables: PyTree) -> None:
        """Puts variables from :meth:`get_weights` back into the live state (same shapes)."""
        self.state_access.set_weights(variables)

    def save_weights(self, filepath: LocalPath, **options: Unpack[weights_lib.WeightsFile]) -> None:
        """The variables (LoRA's merged) as safetensors (``format``), Flax's or PyTorch's ``layout``, ``rename`` pairs
        applied last, ``prefix``: that sub-tree's (docs/finetuning.md)."""
        weights_lib.save(self.state_access.named_weights(), filepath, **options)

    def save_pretrained(self, folder: LocalPath, *, config: object, **options: Unpack[weights_lib.Pretrained]) -> None:
        """A folder Hugging Face's from_pretrained and vLLM read, or LoRA's adapters as PEFT's (docs/finetuning.md)."""
        weights_lib.save_pretrained(self.state_access, folder, config=config, **options)

    def merge_lora(self) -> Trainer:
        """A trainer of the model without adapters, folded into its kernels: the same predictions."""
        return self.arguments.merged_trainer(type(self), self.state_access.merged(), self.strategy or "auto")

    def manifest(self) -> checkpoint_lib.Manifest:
        """What a checkpoint records besides the arrays (JSON; see docs/checkpointing.md)."""
        return checkpoint_lib.manifest_of(self.session, self.strategy, self.state_access.settings())

    def save(self, filepath: LocalPath, **options: Unpack[checkpoint_lib.SaveOptions]) -> int:
        """Writes the state (``weights_only``: the variables) and manifest to ``filepath`` (orbax) at this step, once
        on disk, keeping ``max_to_keep``; refuses an existing step (``overwrite=False``), NaN (``allow_non_finite``)."""
        return checkpoint_lib.save_session(filepath, self.session, self.manifest(), **options)

    def load(
        self, directory: LocalPath | checkpoint_lib.Checkpointer, step: int | None = None
    ) -> checkpoint_lib.Manifest:
        """Restores the latest checkpoint (or ``step``) of any strategy, device count, or weights only, after init."""
        return checkpoint_lib.restore_session(directory, self.session, step, self.strategy)

    def function(self, kind: str) -> TreeFunction:
        """The compiled ``"train"``, ``"eval"`` or ``"predict"`` step (compiled once)."""
        return self.compiled.function(kind)

    def lowered_text(self, sample_batch: DataInput = None) -> str:
        """The train step as StableHLO (default: for the last ``fit``'s batch shape)."""
        return debug.lower_train_step(self, self.setup.placed_sample(sample_batch)).as_text()

    def compiled_text(self, sample_batch: DataInput = None) -> str:
        """The train step as partitioned HLO, with the collectives the compiler inserted."""
        return str(debug.lower_train_step(self, self.setup.placed_sample(sample_batch)).compile().as_text())

    def plan(self, sample_batch: DataInput, **options: Unpack[tuning.PlanOptions]) -> plan_lib.MemoryPlan:
        """The real step compiled under each of ``candidates`` at ``batch_size`` (``first_fit``: up to the first that
        fits; none: with remat, then offload, unless ``add_measures=False``; ``measure``: timed ``steps``) against
        ``memory_limit``: bytes, flops, time, the pick; ``target``: a pod's compile-only devices (docs/targets.md)."""
        return tuning.plan(self.setup, sample_batch, **options)

    def export(self, filepath: LocalPath, format: str | None = None, verbose: bool = True, **options: Any) -> None:
        """Keras 3's ``model.export``: ``predict`` with a symbolic batch axis as ``"jax"``, ``"tf_saved_model"`` or
        ``"onnx"`` (float32) by the suffix, ``format`` or ``"jax"``; under LoRA the merged model (docs/export.md)."""
        model_call, dtype = type(self).apply is Trainer.apply, self.precision.compute_dtype  # onnx: float32 if it can
        export_lib.export(filepath, self.setup.inference, format, dtype, model_call, verbose=verbose, **options)

    def find_batch_size(
        self, x: DataInput, y: PyTree = None, **options: Unpack[tuning.BatchSizeOptions]
    ) -> BatchSizeSearch:
        """The largest global batch (to ``max_batch_size``, ``powers_of_two``) whose compiled step fits ``memory_limit``
        less ``headroom``, by compiling, never an OOM; remat or offload where needed; ``target``: docs/tuning.md."""
        return tuning.find_batch_size(self.setup, x, y, **options)

    def find_learning_rate(
        self, x: DataInput, y: PyTree = None, *, batch_size: int | None, **options: Unpack[lr_finder.RangeOptions]
    ) -> lr_finder.LearningRateSearch:
        """Lightning's range test (``steps``, ``min_lr`` 1e-7 to ``max_lr`` 1, stopped past ``early_stop_threshold``):
        ``lrs``, smoothed ``losses``, ``suggestion``, ``plot(path)``; the trainer restored exactly (docs/tuning.md)."""
        return lr_finder.find_learning_rate(self, x, y, batch_size=batch_size, **options)

    def fit(
        self,
        x: DataInput = None,
        y: PyTree = None,
        batch_size: int | None = None,
        epochs: int | None = None,
        verbose: int | str = 1,
        callbacks: Iterable[Callback] | None = None,
        validation_split: float = 0.0,
        validation_data: DataInput = None,
        shuffle: bool | str = True,
        class_weight: Mapping[int, float] | None = None,
        sample_weight: PyTree = None,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        validation_steps: int | None = None,
        validation_batch_size: int | None = None,
        validation_freq: int | list[int] = 1,
        **options: Unpack[FitOptions],
    ) -> History:
        """Keras's ``fit`` (``x``: docs/data.md): a ``History``, callbacks in Keras 3's order; ``epochs=None``: 1, or
        with ``max_steps`` as many as reach it. ``**options``: trainkit's own (``validation_interval``, ``max_steps``,
        ``read_ahead``, ``data_on_device``: :class:`~trainkit.program.arguments.FitOptions`; unknown names refused)."""
        given = FitArguments.of(locals())
        callbacks = CallbackList.checked(callbacks)  # before anything is built
        with self.session.ledger.running(distributed.take_startup_seconds()):  # history.goodput: where time went
            self.compiled.use_statistics(CallbackList.step_statistics_of(callbacks))  # in the train step
            prepared, config = inputs.prepare_fit(self.setup, given)
            callback_list = CallbackList.for_run(callbacks, self, verbose, config.steps, config.epoch_count, fit=True)
            self.loop.fit(prepared.source, prepared.batch_size, callback_list, config)
        return callback_list.require_history()

    def evaluate(
        self,
        x: DataInput = None,
        y: PyTree = None,
        batch_size: int | None = None,
        verbose: int | str = 0,
        sample_weight: PyTree = None,
        steps: int | None = None,
        callbacks: Iterable[Callback] | None = None,
        return_dict: bool = False,
    ) -> float | list[float] | dict[str, float]:
        """The loss and metrics over all the data, exact on any device count: as Keras, the loss alone
        or ``[loss, *metrics]``, or with ``return_dict`` the dict (prints nothing)."""
        dataset, size, total = inputs.prepare_run(self.setup, x, y, sample_weight, batch_size, steps, targets=True)
        logs = self.loop.evaluate(dataset, size, steps, CallbackList.for_run(callbacks, self, verbose, total))
        return self.objective.keras_result(logs, return_dict)

    def train_on_batch(
        self,
        x: DataInput,
        y: PyTree = None,
        sample_weight: PyTree = None,
        class_weight: dict[int, float] | None = None,
        return_dict: bool = False,
    ) -> float | list[float] | dict[str, float]:
        """One optimizer step on exactly these rows (Keras's ``train_on_batch``, padded to a size the
        devices split): that batch's loss and metrics, as :meth:`evaluate` returns them."""
        size = inputs.one_batch_size(self.strategy, x)
        history = self.fit(x, y, size, 1, 0, sample_weight=sample_weight, class_weight=class_weight, shuffle=False)
        return self.objective.keras_result({k: v[-1] for k, v in history.history.items()}, return_dict)

    def test_on_batch(
        self, x: DataInput, y: PyTree = None, sample_weight: PyTree = None, return_dict: bool = False
    ) -> float | list[float] | dict[str, float]:
        """The loss and metrics of exactly these rows (Keras's ``test_on_batch``)."""
        size = inputs.one_batch_size(self.strategy, x)
        return self.evaluate(x, y, sample_weight=sample_weight, batch_size=size, return_dict=return_dict)

    def predict_on_batch(self, x: DataInput) -> PyTree:
        """The outputs of exactly these rows (Keras's ``predict_on_batch``)."""
        return self.predict(x, batch_size=inputs.one_batch_size(self.strategy, x))

    def predict(
        self,
        x: DataInput = None,
        batch_size: int | None = None,
        verbose: int | str = 0,
        steps: int | None = None,
        callbacks: Iterable[Callback] | None = None,
    ) -> PyTree:
        """Outputs, one row per input row (a pytree for several); ``x`` as ``fit`` takes it, targets ignored."""
        dataset, batch_size, total = inputs.prepare_run(self.setup, x, None, None, batch_size, steps, targets=False)
        return self.loop.predict(dataset, batch_size, steps, CallbackList.for_run(callbacks, self, verbose, total))
