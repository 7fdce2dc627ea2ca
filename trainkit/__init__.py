"""trainkit: Keras-style multi-device training for Flax modules and optax optimizers.

The names below are imported on first use (PEP 562), so ``python -m trainkit.launch`` and the
``python -m trainkit`` commands start without importing JAX; ``tk.Trainer`` imports what it needs.

>>> import trainkit as tk
>>> sorted(n for n in tk.__all__ if n[0].isupper())[:4]
['CheckpointError', 'DataParallel', 'FSDP', 'Hybrid']
>>> tk.Trainer.__name__
'Trainer'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainkit.distributed.lazy import lazy_attributes
from trainkit.version import __version__

if TYPE_CHECKING:  # what __getattr__ imports on first use, for the type checker
    from trainkit import callbacks, data, export, strategies, weights
    from trainkit.attn import attention
    from trainkit.checkpoint import CheckpointError
    from trainkit.core import optimizers
    from trainkit.core.checks import OutOfMemory
    from trainkit.core.lora import LoRA
    from trainkit.core.precision import Precision
    from trainkit.core.spikes import SpikeSkip
    from trainkit.core.state import TrainState
    from trainkit.core.step_state import StepState
    from trainkit.core.step_value import Step
    from trainkit.data import sources
    from trainkit.loop import PREEMPTED_EXIT_CODE, Position, Preempted, StepRecord
    from trainkit.monitoring import debug, loggers
    from trainkit.objective import losses, metrics
    from trainkit.planning import plan
    from trainkit.strategies import FSDP, DataParallel, Hybrid, SingleDevice, Strategy
    from trainkit.trainer import Trainer

#: public name -> (module, attribute of it; None: the module itself)
LAZY: dict[str, tuple[str, str | None]] = {
    "Trainer": ("trainkit.trainer", "Trainer"),
    "Precision": ("trainkit.core.precision", "Precision"),
    "LoRA": ("trainkit.core.lora", "LoRA"),
    "SpikeSkip": ("trainkit.core.spikes", "SpikeSkip"),
    "CheckpointError": ("trainkit.checkpoint", "CheckpointError"),
    "Preempted": ("trainkit.loop", "Preempted"),
    "OutOfMemory": ("trainkit.core.checks", "OutOfMemory"),
    "PREEMPTED_EXIT_CODE": ("trainkit.loop", "PREEMPTED_EXIT_CODE"),
    "Position": ("trainkit.loop", "Position"),
    "StepRecord": ("trainkit.loop", "StepRecord"),
    "TrainState": ("trainkit.core.state", "TrainState"),
    "StepState": ("trainkit.core.step_state", "StepState"),
    "Step": ("trainkit.core.step_value", "Step"),
    "Strategy": ("trainkit.strategies", "Strategy"),
    "SingleDevice": ("trainkit.strategies", "SingleDevice"),
    "DataParallel": ("trainkit.strategies", "DataParallel"),
    "FSDP": ("trainkit.strategies", "FSDP"),
    "Hybrid": ("trainkit.strategies", "Hybrid"),
    "attention": ("trainkit.attn", "attention"),
    "callbacks": ("trainkit.callbacks", None),
    "data": ("trainkit.data", None),
    "export": ("trainkit.export", None),
    "sources": ("trainkit.data.sources", None),
    "loggers": ("trainkit.monitoring.loggers", None),
    "debug": ("trainkit.monitoring.debug", None),
    "plan": ("trainkit.planning.plan", None),
    "losses": ("trainkit.objective.losses", None),
    "metrics": ("trainkit.objective.metrics", None),
    "optimizers": ("trainkit.core.optimizers", None),
    "weights": ("trainkit.weights", None),
    "strategies": ("trainkit.strategies", None),
}

__all__ = [
    "Trainer",
    "Precision",
    "LoRA",
    "SpikeSkip",
    "CheckpointError",
    "Preempted",
    "OutOfMemory",
    "PREEMPTED_EXIT_CODE",
    "Position",
    "StepRecord",
    "TrainState",
    "StepState",
    "Step",
    "Strategy",
    "SingleDevice",
    "DataParallel",
    "FSDP",
    "Hybrid",
    "attention",
    "callbacks",
    "data",
    "export",
    "sources",
    "loggers",
    "debug",
    "plan",
    "losses",
    "metrics",
    "optimizers",
    "weights",
    "strategies",
    "__version__",
]  # the names of LAZY, and the version

#: the packages below trainkit not in ``__all__``, reachable as attributes (``tk.distributed``) as before
SUBPACKAGES = ("checkpoint", "core", "distributed", "loop", "monitoring", "objective", "program")

__getattr__ = lazy_attributes(globals(), LAZY | {name: (f"trainkit.{name}", None) for name in SUBPACKAGES})


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *SUBPACKAGES})
