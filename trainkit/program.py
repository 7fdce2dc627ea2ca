"""``Program``: what one training setup computes, with no state and no devices: the initial
``TrainState``, the pure train / eval / predict steps compiled under a given strategy, and the
compiled plan of a batch under candidate strategies.

>>> import jax, numpy as np, optax, flax.linen as nn
>>> from trainkit import losses, model
>>> from trainkit.precision import get_precision
>>> from trainkit.strategies import SingleDevice
>>> adapter = model.adapt_model(nn.Dense(2))
>>> def compute_loss(params, batch, rng, *, model_state, train):
...     out, model_state = adapter.apply(params, model_state, batch["x"], rng=rng, train=train)
...     return losses.mean_squared_error(out, batch["y"]), (out, model_state)
>>> program = Program(adapter=adapter, compute_loss=compute_loss, apply=adapter.apply, optimizer=optax.sgd(0.1),
...                   metric_fns={}, precision=get_precision("fp32"))
>>> state = program.create_state(SingleDevice(), np.ones((1, 3), np.float32))
>>> int(state.step), state.params["kernel"].shape
(0, (3, 2))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax

from trainkit import plan as plan_lib
from trainkit.model import ModelAdapter, starting_variables
from trainkit.precision import Precision, cast_floating
from trainkit.state import Batch, TrainState
from trainkit.step import make_eval_step, make_predict_step, make_train_step
from trainkit.strategies import Strategy

PyTree = Any


class Program:
    """The pure functions of a setup (see the module docstring).

    Args:
        adapter: the model as ``(init, apply)``.
        compute_loss: ``(params, batch, rng, *, model_state, train) -> (row_loss, (outputs,
            model_state))``.
        apply: the model call under the precision and remat policies.
        optimizer, metric_fns, precision, grad_accum_steps, log_grad_norm, seed: as the
            :class:`trainkit.Trainer` arguments.
        variables: variables to start from (fine-tuning), or ``None``.
        probes: ``{"_name": fn(outputs, targets) -> per-row values}`` the train step also
            averages (not logged; the Trainer reads them after the first step).
    """

    def __init__(
        self,
        *,
        adapter: ModelAdapter,
        compute_loss: Callable,
        apply: Callable,
        optimizer: optax.GradientTransformation,
        metric_fns: Mapping[str, Callable],
        precision: Precision,
        grad_accum_steps: int = 1,
        log_grad_norm: bool = False,
        seed: int = 0,
        variables: PyTree = None,
        probes: Mapping[str, Callable] | None = None,
    ):
        self.adapter, self.compute_loss, self.apply = adapter, compute_loss, apply
        self.optimizer, self.metric_fns, self.precision = optimizer, metric_fns, precision
        self.grad_accum_steps, self.log_grad_norm, self.seed = grad_accum_steps, log_grad_norm, seed
        self.variables = variables
        self.probes = dict(probes or {})  # per-row checks logged by the train step under "_" names

    # ------------------------------------------------------------------ the initial state
    def init_state(self, variables: PyTree, first_row: PyTree) -> TrainState:
        """The state at step 0 (pure: run it under ``jit`` or ``eval_shape``)."""
        init_rng, state_rng = jax.random.split(jax.random.PRNGKey(self.seed))
        params, model_state = self.adapter.init(init_rng, first_row) if variables is None else variables
        params = cast_floating(params, self.precision.param_dtype)
        return TrainState.create(
            params=params, opt_state=self.optimizer.init(params), model_state=model_state, seed=state_rng
        ).replace(loss_scale=self.precision.init_loss_scale())

    def starting_variables(self, first_row: PyTree) -> PyTree:
        return starting_variables(self.adapter, self.variables, first_row)

    def create_state(self, strategy: Strategy, first_row: PyTree) -> TrainState:
        """The state built directly in ``strategy``'s shardings."""
        return strategy.create_state(self.init_state, self.starting_variables(first_row), first_row)

    # ------------------------------------------------------------------ compiled steps
    def compile(self, kind: str, strategy: Strategy, abstract_state: PyTree) -> Callable:
        """The ``"train"``, ``"eval"`` or ``"predict"`` step compiled by ``strategy``."""
        axis = strategy.axis_name
        if kind == "train":
            step = make_train_step(
                self.compute_loss,
                self.optimizer,
                {**self.metric_fns, **self.probes},
                axis,
                grad_accum_steps=self.grad_accum_steps,
                log_grad_norm=self.log_grad_norm,
            )
            return strategy.compile_train(step, abstract_state)
        if kind == "eval":
            return strategy.compile_eval(make_eval_step(self.compute_loss, self.metric_fns, axis), abstract_state)
        return strategy.compile_predict(make_predict_step(self.apply), abstract_state)

    def plan(
        self, host_batch: Batch, candidates: Sequence[Strategy] | None, *, trains: bool, **options
    ) -> plan_lib.MemoryPlan:
        """:func:`trainkit.plan.plan_step` of the train step (or, when ``trains`` is false, the
        predict step) on a padded global batch."""
        kind = "train" if trains else "predict"
        first_row = jax.tree.map(lambda a: np.asarray(a[:1]), host_batch["x"])
        variables = self.starting_variables(first_row)
        return plan_lib.plan_step(
            host_batch,
            candidates if candidates is not None else plan_lib.default_candidates(),
            abstract_state=jax.eval_shape(self.init_state, variables, first_row),
            compile_step=lambda strategy, abstract: self.compile(kind, strategy, abstract),
            create_state=lambda strategy: strategy.create_state(self.init_state, variables, first_row),
            micro_batches=self.grad_accum_steps if trains else 1,
            trains=trains,
            **options,
        )
