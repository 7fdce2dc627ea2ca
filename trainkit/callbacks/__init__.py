"""Callbacks: Keras-named hooks for logging, early stopping and user plugins."""

from trainkit.callbacks.base import Callback, CallbackList, Monitor
from trainkit.callbacks.checkpoint import BackupAndRestore, ModelCheckpoint
from trainkit.callbacks.early_stopping import EarlyStopping
from trainkit.callbacks.history import History
from trainkit.callbacks.logging import CSVLogger, LambdaCallback, TerminateOnNaN
from trainkit.callbacks.progress import ProgressBar

__all__ = [
    "Callback",
    "CallbackList",
    "Monitor",
    "History",
    "ProgressBar",
    "EarlyStopping",
    "CSVLogger",
    "TerminateOnNaN",
    "LambdaCallback",
    "ModelCheckpoint",
    "BackupAndRestore",
]
