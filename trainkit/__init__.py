"""trainkit: Keras-style multi-device training for Flax modules and optax optimizers.

>>> import trainkit as tk
>>> sorted(n for n in tk.__all__ if n[0].isupper())[:4]
['CheckpointError', 'DataParallel', 'FSDP', 'Hybrid']
"""

from trainkit import callbacks, data, export, strategies, weights
from trainkit.checkpoint import CheckpointError
from trainkit.core import optimizers
from trainkit.core.lora import LoRA
from trainkit.core.precision import Precision
from trainkit.core.spikes import SpikeSkip
from trainkit.core.state import TrainState
from trainkit.data import sources
from trainkit.loop import PREEMPTED_EXIT_CODE, Position, Preempted, StepRecord
from trainkit.monitoring import debug, loggers
from trainkit.objective import losses, metrics
from trainkit.program import plan
from trainkit.strategies import FSDP, DataParallel, Hybrid, SingleDevice, Strategy
from trainkit.trainer import Trainer
from trainkit.version import __version__

__all__ = [
    "Trainer",
    "Precision",
    "LoRA",
    "SpikeSkip",
    "CheckpointError",
    "Preempted",
    "PREEMPTED_EXIT_CODE",
    "Position",
    "StepRecord",
    "TrainState",
    "Strategy",
    "SingleDevice",
    "DataParallel",
    "FSDP",
    "Hybrid",
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
]
