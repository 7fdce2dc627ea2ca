"""Objective: what a model is trained and judged on: losses, metrics, metric states and the
multi-output objective (imports ``core``).

>>> from trainkit.objective import Objective
>>> Objective("mse", ["mae"]).log_order
('loss', 'mae')
"""

from trainkit.objective.objective import LossSpec, MetricSpec, Objective

__all__ = ["LossSpec", "MetricSpec", "Objective"]
