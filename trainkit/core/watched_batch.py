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

A key the data did not give is named with the fix (a step reading ``batch["y"]`` of a ``fit``
given no targets), and ``batch.normal(rng, shape)`` / ``batch.all_rows(values)`` are
:mod:`trainkit.core.step_helpers`' draws and gather under the step's device axis (a
``compute_loss``'s noise, the same on every strategy).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from trainkit.core import step_helpers
from trainkit.core.state import Batch
from trainkit.core.tree import PyTree

WEIGHTS = "sample_weight"


@dataclasses.dataclass(frozen=True)
class RowFacts:
    """The step's device axis (``None`` under ``jit``) and, in the built-in step under a device
    axis, the key ``compute_loss`` receives (the device's) and the step's own, which
    :meth:`WatchedBatch.normal` draws from in its place."""

    axis_name: str | None
    device_rng: jax.Array | None = None
    step_rng: jax.Array | None = None


_MISSING = {
    "y": "fit, evaluate or train_on_batch received no targets (y): pass them (fit(x, y) or a dataset of (x, y) "
    "pairs), or leave batch['y'] unread",
    "sample_weight": "no sample_weight was given: read it with batch.get('sample_weight') (None when absent), or "
    "pass fit(..., sample_weight=...)",
}


class WatchedBatch(dict[str, PyTree]):
    """A batch that notes whether its ``sample_weight`` was read (see the module)."""

    read_weights = False
    rows: RowFacts | None = None  # set by the step that hands the batch over

    @classmethod
    def of(cls, batch: Batch, rows: RowFacts | None = None) -> WatchedBatch:
        watched = cls(batch)
        watched.rows = rows
        return watched

    def __missing__(self, key: str) -> PyTree:
        why = _MISSING.get(key, "the data gave no such part")
        raise KeyError(f"batch[{key!r}]: the batch holds {sorted(self)}; {why}.")

    def normal(self, rng: jax.Array, shape: tuple[int, ...] = (), dtype: DTypeLike = jnp.float32) -> jax.Array:
        """``(rows, *shape)`` standard-normal draws keyed by each row's place in the global batch:
        the same numbers on every strategy and device count (a VAE's noise in ``compute_loss``;
        pass the ``rng`` it received as it is)."""
        rows = self._facts("normal")
        if rows.step_rng is not None and rng is rows.device_rng:
            rng = rows.step_rng
        return step_helpers.normal(rng, self, shape, dtype, rows.axis_name)

    def all_rows(self, values: PyTree) -> PyTree:
        """The global batch's rows of per-row ``values`` (an all-gather under a device axis)."""
        return step_helpers.all_rows(values, self._facts("all_rows").axis_name)

    def _facts(self, helper: str) -> RowFacts:
        if self.rows is None:
            raise RuntimeError(
                f"batch.{helper}(...) reads the device axis of the step that handed this batch over, and this batch "
                "was rebuilt (a jax.tree.map or dict(...) of it) or made outside a step: call it on the batch "
                "compute_loss or train_step received."
            )
        return self.rows

    def __getitem__(self, key: str) -> PyTree:
        if key == WEIGHTS:
            self.read_weights = True
        return super().__getitem__(key)

    def get(self, key: str, default: PyTree = None) -> PyTree:
        if key == WEIGHTS:
            self.read_weights = True
        return super().get(key, default)

    def weighting(self) -> Batch:
        """The batch trainkit weights the loss and its logs by: without the weights once the
        loss read them (it applied them), else as it is."""
        if not self.read_weights:
            return dict(self)
        return {key: value for key, value in self.items() if key != WEIGHTS}


def per_token(batch: Batch) -> jax.Array | None:
    """The batch's per-token sample weights for a loss that weighs its elements by them itself (the
    built-in ``compute_loss``: :meth:`trainkit.objective.Objective.loss`), noted as read so the step
    weighs nothing twice; ``None`` where the weights are per row, or none (the step weighs the rows).

    >>> import numpy as np
    >>> batch = WatchedBatch({"mask": np.ones(2), "sample_weight": np.ones((2, 3))})
    >>> per_token(batch).shape, batch.read_weights
    ((2, 3), True)
    """
    weights = step_helpers.token_weights(batch)
    if weights is not None and isinstance(batch, WatchedBatch):
        batch.read_weights = True
    return weights


def _flatten(batch: WatchedBatch) -> tuple[tuple[tuple[jax.tree_util.DictKey, PyTree], ...], tuple[str, ...]]:
    keys = tuple(sorted(batch))  # as a dict flattens; read without noting (a transform reads every leaf)
    return tuple((jax.tree_util.DictKey(key), dict.__getitem__(batch, key)) for key in keys), keys


jax.tree_util.register_pytree_with_keys(
    WatchedBatch, _flatten, lambda keys, values: WatchedBatch(zip(keys, values, strict=True))
)
