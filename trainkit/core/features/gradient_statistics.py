"""Gradient statistics as a step feature (``tk.callbacks.GradientStats``): the norms of
:class:`~trainkit.core.statistics.StepStatistics` on its due steps, as hidden ``_stats/``
metrics.

>>> from trainkit.core.statistics import StepStatistics
>>> callable(measure_statistics(StepStatistics(every=10), "due"))
True
"""

from __future__ import annotations

from trainkit.core.statistics import StepStatistics
from trainkit.core.step_feature import StepFeature, StepUpdate


def measure_statistics(statistics: StepStatistics, when: str) -> StepFeature:
    """The feature: ``statistics`` measured as ``when`` says (``"due"``, ``"always"`` or
    ``"never"``: :meth:`~trainkit.core.statistics.StepStatistics.metrics`) from the step's
    gradients, updates and the parameters it started from."""

    def feature(update: StepUpdate) -> StepUpdate:
        before = update.before
        return update.with_metrics(
            **statistics.metrics(before.step + 1, update.grads, update.updates, before.params, when)
        )

    return feature
