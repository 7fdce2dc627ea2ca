"""``TuningAndExport``: the :class:`trainkit.Trainer` methods around training, on the trainer's
setup: the compiled memory ``plan`` (docs/strategies.md), ``export`` for serving
(docs/export.md), ``find_batch_size`` and ``find_learning_rate`` (docs/tuning.md). A part of
the facade kept in its own file, so that ``trainer.py`` stays Keras's ``fit`` / ``evaluate`` /
``predict``.

>>> import numpy as np, optax, flax.linen as nn, trainkit as tk
>>> trainer = tk.Trainer(nn.Dense(2), loss="mse", optimizer=optax.sgd(0.1), strategy="single")
>>> isinstance(trainer, TuningAndExport), trainer.find_batch_size(
...     np.ones((8, 3), np.float32), np.ones((8, 2), np.float32), max_batch_size=64, memory_limit=2**30, verbose=0
... ).batch_size
(True, 64)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from trainkit import data as data_lib
from trainkit import distributed
from trainkit import export as export_lib
from trainkit.callbacks import lr_finder
from trainkit.core.tree import PyTree
from trainkit.program import plan as plan_lib
from trainkit.program.batch_size import BatchSizeSearch
from trainkit.program.setup import Setup
from trainkit.strategies import Strategy


class TuningAndExport:
    """The plan, export and the finders, for a class with a :class:`~trainkit.program.setup.Setup` as ``setup``."""

    setup: Setup

    def plan(
        self,
        sample_batch: Any,
        *,
        batch_size: int | None = None,
        candidates: Sequence[Strategy] | None = None,
        measure: bool = False,
        memory_limit: int | None = None,
        steps: int = plan_lib.MEASURE_STEPS,
        verbose: int = 1,
    ) -> plan_lib.MemoryPlan:
        """The real train step (predict step without targets) compiled under each candidate:
        per-device bytes, flops, collective bytes, estimated (or ``measure``d) step time, for
        ``batch_size`` (default: an array's rows, 32 rows of a source, an iterable's batch);
        the recommended row is ``"auto"``'s pick (docs/strategies.md)."""
        prepared = data_lib.prepare(sample_batch, batch_size=batch_size, default_batch_size=None)
        options = {"measure": measure, "memory_limit": memory_limit, "steps": steps}
        return self.setup.plan(prepared, candidates, verbose=verbose, **options)

    def export(self, filepath: str | os.PathLike, format: str = "jax", verbose: bool = True, **options) -> None:
        """Keras 3's ``model.export``: ``predict``'s function (eval mode, the precision policy) with a
        symbolic batch axis, as ``"jax"`` (:func:`trainkit.export.load`), ``"tf_saved_model"`` or
        ``"onnx"``; ``platforms=[...]`` / ``opset=`` go to the format (docs/export.md)."""
        export_lib.check_format(format)  # before anything is fetched or traced
        export_lib.write(filepath, *self.setup.inference(), format, verbose=verbose, **options)

    def find_batch_size(
        self,
        x: Any,
        y: PyTree = None,
        *,
        max_batch_size: int = 2**16,
        memory_limit: int | None = None,
        powers_of_two: bool = True,
        verbose: int = 1,
    ) -> BatchSizeSearch:
        """The largest global batch (a multiple of what the strategy splits; powers of two) whose
        compiled train step fits ``memory_limit`` (default: the device's) less the plan's
        headroom; found by compiling, never by an OOM; the same on every process (docs/tuning.md)."""
        result = self.setup.find_batch_size(
            x, y, max_batch_size=max_batch_size, memory_limit=memory_limit, powers_of_two=powers_of_two
        )
        if verbose and distributed.is_main_process():
            print(f"find_batch_size: {result}")
        return result

    def find_learning_rate(
        self,
        x: Any,
        y: PyTree = None,
        *,
        batch_size: int | None,
        min_lr: float = 1e-7,
        max_lr: float = 1.0,
        steps: int = 100,
        early_stop_threshold: float | None = lr_finder.EARLY_STOP_THRESHOLD,
    ) -> lr_finder.LearningRateSearch:
        """Lightning's range test: ``steps`` batches at rates rising from ``min_lr`` to ``max_lr``;
        returns ``lrs``, smoothed ``losses``, the ``suggestion`` (steepest descent) and ``plot(path)``.
        The state, optimizer state and step count are restored exactly (docs/tuning.md)."""
        options = {"min_lr": min_lr, "max_lr": max_lr, "steps": steps, "early_stop_threshold": early_stop_threshold}
        return lr_finder.find_learning_rate(self, x, y, batch_size=batch_size, **options)
