"""The global gradient norm as a step feature (``Trainer(log_grad_norm=True)``): logged as
``grad_norm``, one more pass over the reduced gradients (free when the optimizer clips by norm).

>>> import jax.numpy as jnp
>>> from trainkit.core.step_feature import StepUpdate
>>> update = StepUpdate(before=None, after=None, grads={"w": jnp.array([3.0, 4.0])}, updates=None, metrics={}, batch={})
>>> float(global_grad_norm(update).metrics["grad_norm"].compute())
5.0
"""

from __future__ import annotations

import optax
from clu.metrics import LastValue

from trainkit.core.step_feature import StepUpdate


def global_grad_norm(update: StepUpdate) -> StepUpdate:
    """The feature: the step's global gradient norm as the ``grad_norm`` metric."""
    return update.with_metrics(grad_norm=LastValue(value=optax.tree.norm(update.grads)))
