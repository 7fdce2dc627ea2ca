"""The seam of the train step's features (after optax's ``chain`` and Levanter's
``inside_step``): a feature is a pure function of one step's :class:`StepUpdate` to another,
run inside the compiled step, in order, after the optimizer's update. It may add metrics (the
global gradient norm, gradient statistics, the label check, the learning rate) or replace what
the step writes (spike skipping keeps the old parameters). The core step knows only this seam;
each feature lives in its own module of :mod:`trainkit.core.features`, and the program lists
the ones a trainer's settings ask for (:meth:`trainkit.program.steps.Steps.step_features`).

>>> import jax, jax.numpy as jnp
>>> from clu.metrics import LastValue
>>> def count(update: StepUpdate) -> StepUpdate:  # a feature: how many gradient leaves the step had
...     return update.with_metrics(leaves=LastValue(value=jnp.float32(len(jax.tree.leaves(update.grads)))))
>>> update = StepUpdate(before=None, after=None, grads={"a": 1.0, "b": 2.0}, updates=None, metrics={}, batch={})
>>> float(count(update).metrics["leaves"].compute())
2.0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import clu.metrics

from trainkit.core.state import Batch, TrainState
from trainkit.core.tree import PyTree


@dataclasses.dataclass(frozen=True)
class StepUpdate:
    """One training step as its features see it: the state it started from (``before``) and
    the one it writes (``after``), the reduced gradients and the optimizer's updates, the
    step's metrics (name to a ``clu`` metric state), its (device-local) batch, and the device
    axis under ``pmap`` (``None`` under ``jit``)."""

    before: TrainState
    after: TrainState
    grads: PyTree
    updates: PyTree
    metrics: dict[str, clu.metrics.Metric]
    batch: Batch
    axis_name: str | None = None

    def with_metrics(self, **metrics: clu.metrics.Metric) -> StepUpdate:
        """This update with ``metrics`` added (a new dict: the value is never edited)."""
        return dataclasses.replace(self, metrics={**self.metrics, **metrics})


#: a feature of the train step: pure, traced into the compiled step
StepFeature = Callable[[StepUpdate], StepUpdate]
