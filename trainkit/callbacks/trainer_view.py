"""``TrainerView``: what a callback (its ``self.model``) may use of a trainer, as a protocol, so
that no callback imports ``trainer.py`` (not even for types) and a type checker still reads every
member they touch. :class:`trainkit.Trainer` satisfies it (the type checker checks that where the
trainer hands itself to its callbacks); it extends the monitoring helpers' ``CompiledTrainer``.

>>> import trainkit as tk, optax, flax.linen as nn
>>> trainer: TrainerView = tk.Trainer(nn.Dense(2), loss="mse", optimizer=optax.sgd(0.1), strategy="single")
>>> trainer.global_step, trainer.stop_training
(0, False)
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

from trainkit.checkpoint import Checkpointer
from trainkit.core.local_path import LocalPath
from trainkit.core.precision import Precision
from trainkit.core.state import TrainState
from trainkit.core.tree import PyTree
from trainkit.monitoring.debug import CompiledTrainer


class LearningRateControl(Protocol):
    """The trainer's ``state_access`` as the learning-rate tools use it."""

    def require_settable_learning_rate(self) -> None: ...

    def learning_rates(self) -> dict[str | None, float]: ...

    def set_learning_rate(self, value: float, group: str | None = None) -> None: ...

    def kept(self) -> AbstractContextManager[None]: ...


class MetricDirections(Protocol):
    """The trainer's ``objective`` as ``mode="auto"`` reads it: ``"min"`` / ``"max"`` by logged name."""

    @property
    def directions(self) -> Mapping[str, str | None]: ...


class TrainerView(CompiledTrainer, Protocol):
    """The trainer's members a callback may read or call (Keras's ``self.model`` API and
    trainkit's typed session); anything else is the facade's own."""

    stop_training: bool  # Keras's flag: True stops before the next batch

    @property
    def global_step(self) -> int: ...

    @property
    def steps_per_execution(self) -> int: ...

    @property
    def params(self) -> PyTree: ...

    @property
    def state_access(self) -> LearningRateControl: ...

    @property
    def objective(self) -> MetricDirections: ...

    # the run's configuration, as loggers record it
    @property
    def model(self) -> object: ...

    @property
    def loss(self) -> object: ...

    @property
    def precision(self) -> Precision: ...

    @property
    def grad_accum_steps(self) -> int: ...

    @property
    def seed(self) -> int: ...

    def get_weights(self) -> PyTree: ...

    def set_weights(self, variables: PyTree) -> None: ...

    def update_state(self, **fields: PyTree) -> TrainState: ...

    def manifest(self) -> dict[str, Any]: ...

    def load(self, directory: LocalPath | Checkpointer, step: int | None = None) -> dict[str, Any]: ...
