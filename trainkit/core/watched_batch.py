"""One rule for sample weights and ``compute_loss``: trainkit weights each row's loss by its
``sample_weight``, unless ``compute_loss`` read ``batch["sample_weight"]`` itself, in which case
it applied them and trainkit weights nothing a second time (Keras's guide weights inside its
``compute_loss``: ported as written, that counted every weight twice, a logged loss of 3.83 for 2.81).

The step hands ``compute_loss`` a :class:`WatchedBatch`: a dict (a pytree like one) that notes,
while the step is traced, whether the weights were read (``batch["sample_weight"]`` or
``batch.get("sample_weight")``; a membership test reads nothing).

>>> import numpy as np
>>> batch = WatchedBatch({"x": np.ones(2), "mask": np.ones(2), "sample_weight": np.array([2.0, 0.5])})
>>> _ = batch["x"]; batch.read_weights
False
>>> _ = batch.get("sample_weight"); batch.read_weights
True
>>> import jax; type(jax.tree.map(lambda a: a, batch)) is WatchedBatch   # a pytree as a dict is
True
"""

from __future__ import annotations

from typing import Any

import jax

from trainkit.core.state import Batch

WEIGHTS = "sample_weight"


class WatchedBatch(dict[str, Any]):
    """A batch that notes whether its ``sample_weight`` was read (see the module)."""

    read_weights = False

    def __getitem__(self, key: str) -> Any:
        if key == WEIGHTS:
            self.read_weights = True
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        if key == WEIGHTS:
            self.read_weights = True
        return super().get(key, default)

    def weighting(self) -> Batch:
        """The batch trainkit weights the loss and its logs by: without the weights once the
        loss read them (it applied them), else as it is."""
        if not self.read_weights:
            return dict(self)
        return {key: value for key, value in self.items() if key != WEIGHTS}


def _flatten(batch: WatchedBatch) -> tuple[tuple[tuple[jax.tree_util.DictKey, Any], ...], tuple[str, ...]]:
    keys = tuple(sorted(batch))  # as a dict flattens; read without noting (a transform reads every leaf)
    return tuple((jax.tree_util.DictKey(key), dict.__getitem__(batch, key)) for key in keys), keys


jax.tree_util.register_pytree_with_keys(
    WatchedBatch, _flatten, lambda keys, values: WatchedBatch(zip(keys, values, strict=True))
)
