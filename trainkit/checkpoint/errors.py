"""``CheckpointError``: a checkpoint could not be written or does not fit the model being restored.

>>> issubclass(CheckpointError, RuntimeError)
True
"""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or does not fit the model being restored."""
