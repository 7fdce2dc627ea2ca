"""``GradientStats``: norms of the gradients, parameters and updates, and the update/parameter
ratio, globally and per module, computed inside the compiled train step under any strategy.

>>> import numpy as np, optax, flax.linen as nn, trainkit as tk
>>> class Net(nn.Module):
...     @nn.compact
...     def __call__(self, x):
...         return nn.Dense(2, name="head")(nn.relu(nn.Dense(8, name="hidden")(x)))
>>> x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32"); y = (x[:, 0] > 0).astype("int32")
>>> trainer = tk.Trainer(Net(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single")
>>> stats = GradientStats(every=2, per_layer="hidden")
>>> history = trainer.fit((x, y), batch_size=16, epochs=2, verbose=0, callbacks=[stats])
>>> sorted(name for name in history.history if "hidden" in name)
['grad_norm/hidden', 'param_norm/hidden', 'update_norm/hidden', 'update_ratio/hidden']
>>> stats.steps   # the steps measured
[2, 4, 6, 8]
"""

from __future__ import annotations

import os

import jax
import numpy as np

from trainkit import distributed
from trainkit.callbacks.base import Callback, Logs
from trainkit.core.local_path import LocalPath, require_local
from trainkit.core.statistics import PREFIX, StepStatistics, module_of
from trainkit.core.tree import leaf_name
from trainkit.loop.dispatch import host_metric
from trainkit.monitoring import loggers


class GradientStats(Callback):
    """Every ``every`` optimizer steps, the global norms of the gradients (after the all-reduce),
    the parameters (before the update) and the updates, and ``update_norm / param_norm``; for
    each module whose path matches the regex ``per_layer`` (``re.search``, e.g. ``"Dense"`` or
    ``".*"``) the same per module, named ``grad_norm/<module path>``.

    The train step computes them on those steps only (one step per call: the loop calls a
    step compiled to measure on them, another on the rest once a fit has run long enough to
    repay its compile, :mod:`trainkit.loop.measuring`; a fused ``steps_per_execution``
    call, of at most ``every`` steps so that no measured step is missed, measures under a
    ``lax.cond``: a larger explicit ``steps_per_execution`` is refused), and keeps them on the
    device with the epoch's metrics (one vector): they reach the host only on the steps they
    are logged, so the loop never waits for the device in between. They are added to that
    step's batch logs (callbacks after this one, ``Logging`` and ``TensorBoard`` with a
    matching ``update_freq``, see them), and their mean over the epoch's measured steps (the
    latest, when it measured none) to every epoch's logs (``history.history["grad_norm/hidden"]``).
    With ``log_dir``, each measured step is written to TensorBoard there (``log_dir/train``):
    the scalars, and a histogram per kind over the modules (``grad_norm_by_module``).

    ``values`` holds the latest measurement, ``steps`` the steps measured in this ``fit``.
    """

    async_safe = True  # it reads the totals of the step it is about, which the device keeps

    def __init__(self, every: int = 100, per_layer: str | None = None, log_dir: LocalPath | None = None):
        self.spec = StepStatistics(every, per_layer)
        self.log_dir = None if log_dir is None else require_local(log_dir, "GradientStats' log_dir")
        self.values: dict[str, float] = {}
        self.steps: list[int] = []
        self.board: loggers.TensorBoardLogger | None = None
        self._names: list[str] | None = None  # the statistics' names, read at the first measured step
        self._epoch: list[dict[str, float]] = []  # this epoch's measurements (its log is their mean)

    def step_statistics(self) -> StepStatistics:
        return self.spec

    def execution_cap(self) -> int | None:
        """``every``: a fused call of at most ``every`` steps covers at most one measured step
        (``steps_per_execution="auto"`` stays within it)."""
        return self.spec.every

    def on_train_begin(self, logs: Logs | None = None) -> None:
        fused = self.model.steps_per_execution
        if fused > self.spec.every:  # "auto" trains 1 step per call until it decides, then within every
            raise ValueError(
                f"GradientStats(every={self.spec.every}) with steps_per_execution={fused}: one fused call of {fused} "
                f"steps can cover two measured steps and would keep only the last. Pass every >= {fused} (e.g. "
                f"every={fused * max(1, -(-self.spec.every // fused))}) or steps_per_execution <= {self.spec.every} "
                '(or "auto", which stays within every).'
            )
        self.values, self.steps, self._names = {}, [], None
        if self.spec.per_layer is not None:
            params = self.session.require_state().params
            if not self.spec.modules(params):
                paths = sorted({module_of(leaf_name(p)) for p, _ in jax.tree_util.tree_leaves_with_path(params)})
                raise ValueError(
                    f"GradientStats(per_layer={self.spec.per_layer!r}) matches no module path, so no module's norms "
                    f"would be reported. The model's modules: {', '.join(paths[:8])} (re.search on these paths)."
                )
        if self.log_dir is not None and distributed.is_main_process():
            try:  # before the first step, not at the first write of a measured one
                os.makedirs(os.path.join(self.log_dir, "train"), exist_ok=True)
            except OSError as error:
                raise ValueError(
                    f"GradientStats(log_dir={self.log_dir!r}) cannot be written ({error.strerror}: "
                    f"{error.filename}): pass a folder (it is created, with train/ inside)."
                ) from None
            self.board = loggers.TensorBoardLogger(self.log_dir)

    def _due(self) -> bool:
        record = self.session.record
        return record is not None and record.covers_multiple(self.spec.every)

    def batch_end_period(self) -> int | None:
        return self.spec.every  # its batch-end hook acts on the measured steps only

    def reads_batch_logs(self) -> bool:
        return False  # it adds its values, which reach the callbacks after it that read the logs

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        carry = self.session.carry
        if not self._due() or carry is None:
            return
        vector = host_metric(carry, PREFIX + "values")  # one small device read, on this step only
        if self._names is None:  # the parameters' structure is the fit's: read once (building the state costs ms)
            self._names = self.spec.names(self.session.require_state().params)
        names = self._names
        self.values = {name: float(value) for name, value in zip(names, np.asarray(vector.value), strict=True)}
        self._epoch.append(self.values)
        record = self.session.require_record()
        self.steps.append(record.step // self.spec.every * self.spec.every)  # the last multiple it covers
        if logs is not None:
            logs.update(self.values)
        if self.board is not None:
            self.board.log_metrics(self.steps[-1], self.values, "train", prefix="")
            self.board.log_histograms(self.steps[-1], self._by_module(), "train")

    def _by_module(self) -> dict[str, np.ndarray]:
        """Each kind's per-module values as one array (a histogram over the modules)."""
        kinds: dict[str, list[float]] = {}
        for name, value in self.values.items():
            if "/" in name:
                kinds.setdefault(f"{name.split('/', 1)[0]}_by_module", []).append(value)
        return {kind: np.asarray(values) for kind, values in kinds.items()}

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._epoch = []

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if logs is None:
            return
        if not self._epoch:  # no step of this epoch was due: the latest measurement
            logs.update(self.values)
            return
        logs.update({name: float(np.mean([m[name] for m in self._epoch])) for name in self._epoch[0]})

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None

    def on_exception(self, exception: BaseException) -> None:
        self.on_train_end()
