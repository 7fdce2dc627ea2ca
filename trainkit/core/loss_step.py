"""The built-in step as a value (#82): :class:`LossStep`, a :class:`~trainkit.core.step_value.Step`
whose fields are what it trains by (the loss, the metrics and :class:`~trainkit.core.step.TrainStepOptions`:
micro-batches, the trainable leaves, the features such as spike skipping, offload, the optimizer's
groups) and whose compiled forms are :func:`~trainkit.core.step.make_train_step`'s and
:func:`~trainkit.core.step.make_eval_step`'s. It owns what a step of the user's cannot: the loss
scale (fp16), the spikes' history, gradient accumulation and the features that read its one
gradient. A step of the user's compiles through the same seam (:meth:`Step.train_metrics`), so
the program holds one value per kind of step and asks it for its compiled form.

>>> import jax, jax.numpy as jnp, optax
>>> from trainkit.core.state import TrainState
>>> from trainkit.core.step_state import StepFacts
>>> from trainkit.core.trainable import Trainable
>>> def compute_loss(params, batch, rng, *, model_state, train):
...     preds = batch["x"] * params
...     return (preds - batch["y"]) ** 2, (preds, model_state)
>>> tx = optax.sgd(0.1)
>>> facts = StepFacts(axis_name=None, optimizer=tx, groups=None, trainable=Trainable(None))
>>> state = TrainState.create(params=jnp.zeros(()), opt_state=tx.init(jnp.zeros(())), model_state={}, seed=0)
>>> batch = {"x": jnp.ones((4,)), "y": jnp.full((4,), 2.0), "mask": jnp.array([1.0, 1, 1, 0])}
>>> state, metrics = LossStep(compute_loss).train_metrics(facts)(state, batch)
>>> round(float(state.params), 3), float(metrics["loss"].compute()), LossStep(compute_loss).trains
(0.4, 4.0, False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from trainkit.core.step import LossFn, TrainStepOptions, make_eval_step, make_train_step
from trainkit.core.step_state import StepFacts
from trainkit.core.step_value import EvalMetricsStep, Step, TrainMetricsStep
from trainkit.core.totals import MetricFn


@dataclasses.dataclass(frozen=True)
class LossStep(Step):
    """The built-in step: ``compute_loss``'s per-row loss averaged over the real rows of the
    global batch, its gradient applied by the facts' optimizer, ``metric_fns`` measured on its
    predictions, as ``options`` say. It defines no ``train``: it is not a step of the user's
    (``trains`` is false), and the built-in evaluation is its :meth:`test_metrics`."""

    compute_loss: LossFn
    metric_fns: Mapping[str, MetricFn] = dataclasses.field(default_factory=dict)
    options: TrainStepOptions = TrainStepOptions()

    def train_metrics(self, facts: StepFacts) -> TrainMetricsStep:
        return make_train_step(self.compute_loss, facts.optimizer, self.metric_fns, facts.axis_name, self.options)

    def test_metrics(self, facts: StepFacts) -> EvalMetricsStep:
        return make_eval_step(self.compute_loss, self.metric_fns, facts.axis_name, self.options.valid_tokens)
