"""The global gradient norm as a step feature (``Trainer(log_grad_norm=True)``): logged as
``grad_norm``, one more pass over the reduced gradients (free when the optimizer clips by norm);
an epoch's log is the mean over its steps, as the other logs are means. A step whose norm is not
finite behind a finite loss is the epoch's first non-finite step (:class:`~trainkit.core.totals.EpochTotals`),
so the warning and ``TerminateOnNaN`` name the step whose gradient went wrong, not the next one.

>>> import jax.numpy as jnp
>>> from trainkit.core.step_feature import StepUpdate
>>> update = StepUpdate(before=None, after=None, grads={"w": jnp.array([3.0, 4.0])}, updates=None, metrics={}, batch={})
>>> float(global_grad_norm(update).metrics["grad_norm"].compute())
5.0
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from trainkit.core.step_feature import StepUpdate
from trainkit.core.totals import GRAD_NORM, WeightedAverage


def global_grad_norm(update: StepUpdate) -> StepUpdate:
    """The feature: the step's global gradient norm as the ``grad_norm`` metric (one step's
    value, averaged over the steps merged)."""
    norm = optax.tree.norm(update.grads).astype(jnp.float32)
    return update.with_metrics(**{GRAD_NORM: WeightedAverage(total=norm, count=jnp.float32(1))})
