"""What a ``Trainer`` and its ``fit`` were given, each as one frozen value: the facade hands the
value on instead of repeating its twenty-odd names, and a trainer rebuilt from it (``merge_lora``)
takes everything it was made with.

``TrainerArguments`` holds ``Trainer(...)``'s arguments as given; :class:`TrainerOptions` types
trainkit's own options (beyond Keras's ``compile``), which ``Trainer`` takes as ``**options``,
an unknown name refused with the known ones. ``FitArguments`` holds ``fit(...)``'s (its own options
typed by :class:`FitOptions`), turned into the run's :class:`~trainkit.data.FitConfig` by
:meth:`FitArguments.config`. Keras's arguments stay named in the signatures; trainkit's own are options.

>>> import optax, flax.linen as nn
>>> given = TrainerArguments.of({"self": None, "model": nn.Dense(2), "loss": "mse", "optimizer": optax.sgd(0.1),
...                              "options": {"precision": "bf16"}})
>>> given.precision, given.grad_accum_steps, given.strategy
('bf16', 1, 'auto')
>>> TrainerArguments.of({"model": nn.Dense(2), "optimizer": optax.sgd(0.1), "options": {"precison": "bf16"}})
Traceback (most recent call last):
TypeError: Trainer got an unknown option precison='bf16' (did you mean precision?); ...
>>> FitArguments.of({"self": None, "x": None, "epochs": 2, "options": {"max_steps": 10}}).config(seed=0).max_steps
10
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypedDict, TypeVar

import numpy as np
import optax

from trainkit import distributed
from trainkit.core import override_step
from trainkit.core.lora import LoRA
from trainkit.core.model import Model, adapt_model
from trainkit.core.offload import Offload
from trainkit.core.precision import Precision, get_precision
from trainkit.core.remat import Remat
from trainkit.core.spikes import SpikeSkip
from trainkit.core.step import LossFn
from trainkit.core.trainable import TrainableSpec
from trainkit.core.tree import Apply, PyTree
from trainkit.data import DataInput, FitConfig
from trainkit.objective import LossSpec, MetricSpec, Objective
from trainkit.program.program import Program
from trainkit.program.setup import Setup
from trainkit.record.session import Session
from trainkit.strategies import Auto, Strategy


class _Initialisable(Protocol):
    def init(self, sample_batch: DataInput) -> object: ...


#: a trainer (of the class ``merge_lora`` is called on), as this module sees it: it initialises from a sample
Initialised = TypeVar("Initialised", bound=_Initialisable)


class TrainerOptions(TypedDict, total=False):
    """trainkit's own ``Trainer`` options, beyond Keras's ``compile`` (``Trainer(model, ..., **options)``;
    the defaults: :class:`TrainerArguments`'s).

    Attributes:
        precision: ``"fp32"`` (the default), ``"bf16"``, ``"fp16"`` (loss scaling) or a ``tk.Precision``.
        remat: ``"full"``, ``"dots"``, ``"dots_no_batch"``, a ``jax.checkpoint`` policy, or class names.
        grad_accum_steps: micro-batches per global batch in one step (1).
        log_grad_norm: also log ``grad_norm``, the global gradient norm.
        mixes_rows: the model mixes a batch's rows on purpose (else checked before training).
        deterministic: XLA's deterministic GPU ops, and no choice by timing (docs/tuning.md).
        trainable: the parameters that train (a path regex, a list, ``(path, leaf) -> bool``); the others frozen,
            their BatchNorm in inference mode unless ``frozen_statistics=False`` (docs/finetuning.md).
        lora: a ``tk.LoRA``: low-rank adapters (qwix) on the kernels it targets (linen or NNX); only they train.
        skip_spikes: a ``tk.SpikeSkip``: an update whose loss spikes above its running average is not applied.
        frozen_statistics: the BatchNorm of frozen layers in inference mode (``True``, the default).
        offload: ``"optimizer"`` (``"optimizer+frozen"``: and the frozen parameters) in host memory, streamed
            through each step, the same numbers; ``"auto"``: where the step fits only so.
        step: a ``tk.Step``: a train step of your own as a frozen value (docs/custom_training.md).
    """

    precision: str | Precision | None
    remat: Remat
    grad_accum_steps: int
    log_grad_norm: bool
    mixes_rows: bool
    deterministic: bool
    trainable: TrainableSpec
    lora: LoRA | None
    skip_spikes: SpikeSkip | None
    frozen_statistics: bool
    offload: str | Offload | None
    step: override_step.Step | None


class FitOptions(TypedDict, total=False):
    """trainkit's own ``fit`` options, beyond Keras's (``trainer.fit(x, ..., **options)``; the defaults:
    :class:`FitArguments`'s).

    Attributes:
        validation_interval: validate every this many optimizer steps (besides ``validation_freq``'s epochs).
        max_steps: stop after this many optimizer steps (with ``epochs=None``: as many epochs as reach it).
        read_ahead: data may be read in a background thread (``True``; ``False``: every element in the thread
            that calls ``fit``).
        data_on_device: in-memory arrays kept on the devices, a fused call gathering its rows there
            (``"auto"``, ``True`` or ``False``; docs/data.md).
    """

    validation_interval: int | None
    max_steps: int | None
    read_ahead: bool
    data_on_device: bool | str


def _given(values: Mapping[str, Any], known: Mapping[str, object], where: str) -> dict[str, Any]:
    """A method's ``locals()`` at its first line, less ``self``, its ``**options`` flattened into them:
    the arguments it was called with; an option not ``known`` refused by name, with the nearest known one."""
    given = {name: value for name, value in values.items() if name != "self"}
    options: dict[str, Any] = given.pop("options", {})
    for name, value in options.items():
        if name not in known:
            near = difflib.get_close_matches(name, [*given, *known], n=1)  # Keras's names too: metric= -> metrics
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise TypeError(
                f"{where} got an unknown option {name}={value!r}{hint}; its options beyond Keras's arguments are "
                f"{', '.join(known)} (the {where} docstring says what each does)."
            )
    return given | options


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerArguments:
    """``Trainer(...)``'s arguments as given (the ``Trainer`` docstring says what each does)."""

    model: Model
    loss: LossSpec = None
    optimizer: optax.GradientTransformation | dict[str, optax.GradientTransformation]
    metrics: MetricSpec = None
    weighted_metrics: MetricSpec = None
    loss_weights: float | Sequence[float] | Mapping[str, float] | None = None
    strategy: str | Strategy | Auto = "auto"
    seed: int = 0
    params: PyTree | None = None
    steps_per_execution: int | str | None = None
    run_eagerly: bool = False
    jit_compile: bool | str = "auto"
    precision: str | Precision | None = "fp32"
    remat: Remat = None
    grad_accum_steps: int = 1
    log_grad_norm: bool = False
    mixes_rows: bool = False
    deterministic: bool = False
    trainable: TrainableSpec = None
    lora: LoRA | None = None
    skip_spikes: SpikeSkip | None = None
    frozen_statistics: bool = True
    offload: str | Offload | None = None
    step: override_step.Step | None = None

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> TrainerArguments:
        """From ``Trainer.__init__``'s ``locals()``: its named arguments and its ``options``, an option
        trainkit does not know refused by name (with the nearest known one)."""
        return cls(**_given(values, TrainerOptions.__annotations__, "Trainer"))

    def connect(self) -> None:
        """XLA's flags for ``deterministic`` set and a multi-process job connected: before anything
        touches the devices (XLA reads its flags when the backend starts)."""
        if self.deterministic:
            distributed.enable_determinism()
        distributed.initialize_from_environment()

    def checked(self, own: override_step.Overrides) -> TrainerArguments:
        """These arguments, the ones that cannot work refused, saying what to pass (``own``: what the
        trainer's class overrides)."""
        if self.loss is None and not own.loss:
            raise ValueError("Pass loss=..., or subclass Trainer and override compute_loss (or train_step).")
        if not isinstance(self.optimizer, (optax.GradientTransformation, dict)):
            raise TypeError(
                f"optimizer must be an optax.GradientTransformation such as optax.adam(1e-3), or a dict of them by "
                f"parameter path (one per sub-network); received {type(self.optimizer).__name__}."
            )
        if not isinstance(self.grad_accum_steps, (int, np.integer)) or self.grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be a positive integer; received {self.grad_accum_steps!r}.")
        if self.jit_compile not in (True, False, "auto"):
            raise ValueError(f"jit_compile must be True, False or 'auto'; received {self.jit_compile!r}.")
        return self

    @property
    def eager(self) -> bool:
        """Each step runs op by op (``run_eagerly=True`` or ``jit_compile=False``, as Keras reads them)."""
        return bool(self.run_eagerly) or self.jit_compile is False

    def objective(self, own: override_step.Overrides) -> Objective:
        """The loss and metrics (``own``: whether the trainer's class computes its own loss)."""
        return Objective(self.loss, self.metrics, self.weighted_metrics, self.loss_weights, own_loss=own.compute_loss)

    def program(
        self, objective: Objective, *, compute_loss: LossFn, apply: Apply, step: override_step.Step | None
    ) -> Program:
        """The trainer's pure functions (``compute_loss`` and ``apply``: its, maybe overridden; ``step``:
        the step value it runs, ``None`` for the built-in one)."""
        precision = get_precision(self.precision)  # a name refused before the model is read
        return Program(
            adapter=adapt_model(self.model),
            remat=self.remat,
            compute_loss=compute_loss,
            apply=apply,
            seed=int(self.seed),
            optimizer=self.optimizer,
            objective=objective,
            precision=precision,
            eager=self.eager,
            grad_accum_steps=int(self.grad_accum_steps),
            log_grad_norm=bool(self.log_grad_norm),
            variables=self.params,
            lora=self.lora,
            trainable=self.trainable,
            spike_skip=self.skip_spikes,
            frozen_statistics=self.frozen_statistics,
            offload=Offload.of(self.offload),
            step=step,
        )

    def setup(self, program: Program, session: Session, own: override_step.Overrides) -> Setup:
        """The trainer's setup over ``program`` and ``session``."""
        return Setup(
            program,
            self.strategy,
            session=session,
            steps_per_execution=self.steps_per_execution,
            custom_loss=own.loss,
            mixes_rows=self.mixes_rows,
            deterministic=self.deterministic,
        )

    def without_lora(self, variables: PyTree, strategy: str | Strategy | Auto) -> dict[str, Any]:
        """The keyword arguments of the same trainer without adapters (``Trainer.merge_lora``): the
        model and each argument given other than its default (a subclass's own ``__init__`` receives
        what it was given), from ``variables`` (the merged ones) on ``strategy``, every parameter
        training."""
        given = {
            field.name: self.__dict__[field.name]
            for field in dataclasses.fields(self)
            if field.name not in ("lora", "trainable") and self.__dict__[field.name] is not field.default
        }
        return given | {"params": variables, "strategy": strategy}

    def merged_trainer(
        self, cls: Callable[..., Initialised], merged: tuple[PyTree, PyTree], strategy: str | Strategy | Auto
    ) -> Initialised:
        """``Trainer.merge_lora``'s trainer: ``cls`` (the trainer's class) made from :meth:`without_lora`'s
        arguments and initialised, from ``merged``: the merged variables and a sample batch to initialise with."""
        variables, sample = merged
        trainer = cls(**self.without_lora(variables, strategy))
        trainer.init(sample)
        return trainer


@dataclasses.dataclass(frozen=True, kw_only=True)
class FitArguments:
    """``fit(...)``'s arguments as given (Keras's, then trainkit's; ``Trainer.fit`` says what each does)."""

    x: DataInput = None
    y: PyTree = None
    batch_size: int | None = None
    epochs: int | None = None
    verbose: int | str = 1
    callbacks: Iterable[object] | None = None
    validation_split: float = 0.0
    validation_data: DataInput = None
    shuffle: bool | str = True
    class_weight: Mapping[int, float] | None = None
    sample_weight: PyTree = None
    initial_epoch: int = 0
    steps_per_epoch: int | None = None
    validation_steps: int | None = None
    validation_batch_size: int | None = None
    validation_freq: int | list[int] = 1
    validation_interval: int | None = None
    max_steps: int | None = None
    read_ahead: bool = True
    data_on_device: bool | str = "auto"

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> FitArguments:
        """From ``Trainer.fit``'s ``locals()`` at its first line (its ``**options`` flattened)."""
        return cls(**_given(values, FitOptions.__annotations__, "Trainer.fit"))

    def config(self, seed: int) -> FitConfig:
        """The run's settings, each refused with a clear error before anything runs (``seed``: the
        trainer's, which orders the shuffle)."""
        return FitConfig(
            epochs=self.epochs,
            initial_epoch=self.initial_epoch,
            steps_per_epoch=self.steps_per_epoch,
            max_steps=self.max_steps,
            shuffle=self.shuffle,
            seed=seed,
            validation_freq=self.validation_freq,
            validation_steps=self.validation_steps,
            validation_interval=self.validation_interval,
            read_ahead=self.read_ahead,
            data_on_device=self.data_on_device,
        ).checked(has_validation=self.validation_data is not None or bool(self.validation_split))
