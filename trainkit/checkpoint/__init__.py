"""Checkpoints: bytes on disk: orbax checkpoints of the whole state with a JSON manifest,
written in the background, restored into any strategy (imports ``core``, ``distributed``).

>>> from trainkit.checkpoint import CheckpointError
>>> issubclass(CheckpointError, RuntimeError)
True
"""

from trainkit.checkpoint.checkpointer import Checkpointer, CheckpointError, all_finite, check_writable
from trainkit.checkpoint.files import SaveOptions, remove_checkpoints, restore, restore_session, save, save_session
from trainkit.checkpoint.manifest import Manifest, build_manifest, checked_position, explain_restore, manifest_of

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "all_finite",
    "Manifest",
    "build_manifest",
    "check_writable",
    "checked_position",
    "explain_restore",
    "manifest_of",
    "remove_checkpoints",
    "restore",
    "restore_session",
    "save",
    "save_session",
    "SaveOptions",
]
