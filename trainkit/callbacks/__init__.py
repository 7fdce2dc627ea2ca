"""Callbacks with Keras 3's names, arguments and hook order, plus trainkit's own."""

from trainkit.callbacks.backup_and_restore import BackupAndRestore
from trainkit.callbacks.base import Callback, MonitorCallback
from trainkit.callbacks.callback_list import CallbackList
from trainkit.callbacks.csv_logger import CSVLogger
from trainkit.callbacks.early_stopping import EarlyStopping
from trainkit.callbacks.gradient_stats import GradientStats
from trainkit.callbacks.history import History
from trainkit.callbacks.lambda_callback import LambdaCallback
from trainkit.callbacks.learning_rate import LearningRateScheduler, ReduceLROnPlateau
from trainkit.callbacks.model_checkpoint import ModelCheckpoint
from trainkit.callbacks.monitoring import Logging, Profiler, TensorBoard
from trainkit.callbacks.progress import ProgbarLogger, ProgressBar
from trainkit.callbacks.ray_train_report import RayTrainReport
from trainkit.callbacks.swap_ema_weights import SwapEMAWeights
from trainkit.callbacks.terminate_on_nan import TerminateOnNaN

__all__ = [
    "Callback",
    "CallbackList",
    "MonitorCallback",
    "History",
    "ProgressBar",
    "ProgbarLogger",
    "EarlyStopping",
    "CSVLogger",
    "TerminateOnNaN",
    "LambdaCallback",
    "ModelCheckpoint",
    "BackupAndRestore",
    "ReduceLROnPlateau",
    "LearningRateScheduler",
    "SwapEMAWeights",
    "TensorBoard",
    "Logging",
    "Profiler",
    "GradientStats",
    "RayTrainReport",
]
