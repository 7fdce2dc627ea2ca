"""The label check as a step feature: class ids outside the model's classes counted inside
the step (a :class:`~trainkit.core.totals.LabelAlarm` the loop raises as an error naming the
step), where a per-batch host check would cost a device read.

>>> import jax.numpy as jnp
>>> alarm = label_alarm(jnp.int32(2), jnp.int32(7), jnp.int32(3), None)
>>> int(alarm.count), int(alarm.value), int(alarm.step)
(2, 7, 3)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from trainkit.core.step_feature import StepFeature, StepUpdate
from trainkit.core.totals import LABEL_ALARM, LabelAlarm
from trainkit.core.tree import PyTree

#: ``labels -> (count, one bad value)`` of the labels outside the classes, ``None`` for none to check
LabelCounter = Callable[[PyTree], tuple[jax.Array, jax.Array] | None]


def label_alarm(count: jax.Array, value: jax.Array, step: jax.Array, axis_name: str | None) -> LabelAlarm:
    """The step's :class:`LabelAlarm` from this device's count and one bad label (under a
    named axis: the count summed over the devices, the largest bad label kept)."""
    if axis_name is not None:
        value = jax.lax.pmax(jnp.where(count > 0, value, jnp.iinfo(jnp.int32).min), axis_name)
        count = jax.lax.psum(count, axis_name)
    found = count > 0
    return LabelAlarm(count, jnp.where(found, value, 0), jnp.where(found, step, 0).astype(jnp.int32))


def check_labels(count_outside: LabelCounter) -> StepFeature:
    """The feature: the batch's labels outside the classes (``count_outside(y)``) as the step's alarm."""

    def feature(update: StepUpdate) -> StepUpdate:
        labels = count_outside(update.batch.get("y"))
        if labels is None:
            return update
        alarm = label_alarm(labels[0], labels[1], update.after.step, update.axis_name)
        return update.with_metrics(**{LABEL_ALARM: alarm})

    return feature
