"""Watching a run: ``Logging`` (any :mod:`trainkit.monitoring.loggers` backend), ``TensorBoard`` (Keras 3's
callback, written with tensorboardX), and ``Profiler`` (a ``jax.profiler`` trace of chosen
steps). Only process 0 writes; every hook is ``async_safe`` (nothing waits for the device).

>>> Profiler("/tmp/trace", steps=(3, 5)).steps
(3, 5)
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, cast

import jax
import numpy as np

from trainkit import distributed
from trainkit.callbacks.base import Callback, Logs
from trainkit.callbacks.trainer_view import TrainerView
from trainkit.core import optimizers
from trainkit.core.local_path import LocalPath, require_local
from trainkit.core.redact import redacted
from trainkit.core.tree import leaf_name
from trainkit.core.warn import warn_user
from trainkit.monitoring import debug, loggers, throughput
from trainkit.record.session import Session

logger = logging.getLogger("trainkit")


def run_config(trainer: TrainerView) -> loggers.RunConfig:
    """The run's hyperparameters, logged once per ``fit``: model, parameter count, loss,
    optimizer (its injected hyperparameters), strategy, precision, batch size, accumulation,
    seed, devices and processes. Reads shapes and replicated scalars only (no gather), so any
    process may call it alone."""
    state = trainer.state
    config: loggers.RunConfig = {
        "model": type(trainer.model).__name__,
        "parameters": int(sum(leaf.size for leaf in jax.tree.leaves(state.params))) if state is not None else 0,
        "loss": str(trainer.loss),
        "strategy": trainer.strategy.describe() if trainer.strategy is not None else "",
        "precision": str(trainer.precision.compute_dtype),
        "batch_size": trainer.session.batch_size,
        "grad_accum_steps": trainer.grad_accum_steps,
        "seed": trainer.seed,
        "devices": jax.device_count(),
        "processes": jax.process_count(),
    }
    try:
        if state is None:
            return config
        config["optimizer"] = optimizers.describe(state.opt_state)
        hyperparameters = optimizers.hyperparameters(distributed.fetch(optimizers.injected(state.opt_state)))
        config.update({f"optimizer/{k}": v for k, v in hyperparameters.items()})
    except Exception:  # noqa: BLE001 - an optimizer without injected hyperparameters
        pass
    return config


def _step(session: Session) -> int:
    """The optimizer step of the batch a batch hook is about (the loop may have dispatched
    later steps already: these hooks are ``async_safe``)."""
    record = session.record
    return record.step if record is not None else session.position.step


def _due(session: Session, every: int | str) -> bool:
    """Whether a batch hook's execution covered a multiple of ``every`` steps (each step with
    ``steps_per_execution=1``; never for ``"epoch"``)."""
    if isinstance(every, str):  # "epoch"
        return False
    record = session.record
    return record.covers_multiple(every) if record is not None else session.position.step % every == 0


def _split_runs(logs: Logs) -> tuple[Logs, Logs]:
    train = {k: v for k, v in logs.items() if not k.startswith("val_")}
    validation = {k[4:]: v for k, v in logs.items() if k.startswith("val_")}
    return train, validation


class _Rate(Callback):
    """Examples/s (tokens/s, TFLOP/s, MFU and HFU) over the steps since the last reading."""

    async_safe = True

    def __init__(self, tokens_per_example: int | None = None):
        self.tokens_per_example = tokens_per_example
        self.meter: throughput.Meter | None = None
        self._mark: tuple[int, float] | None = None

    def _start_meter(self) -> None:
        trainer = self.model
        devices = jax.devices()
        precision = np.dtype(trainer.precision.compute_dtype).name
        peak = throughput.peak_flops(devices[0].device_kind, precision)
        flops = model = None
        try:  # where MFU is known, the compiled step's count (docs/monitoring.md); else the lowered step's
            if peak is not None:
                counted = debug.compiled_step_flops(trainer)  # a compile: a persistent-cache hit for a real model
                flops = None if counted is None else counted.total
                model = debug.model_step_flops(trainer)  # the model's own: MFU (docs/monitoring.md)
            else:  # a CPU: TFLOP/s only, without compiling the step again
                flops = debug.step_flops(trainer)
        except Exception:  # noqa: BLE001 - a strategy without .lower(): no FLOP figures
            logger.info("monitoring: the train step's flops are unknown; no TFLOP/s or MFU.", exc_info=True)
        self.meter = throughput.Meter(
            examples_per_step=trainer.session.batch_size or 0,
            tokens_per_example=self.tokens_per_example,
            flops_per_step=flops,
            peak_flops=None if peak is None else peak * len(devices),
            model_flops_per_step=model,
        )

    def _learning_rate(self) -> dict[str, float]:
        """``{"learning_rate": ...}`` (``learning_rate/<group>`` each under an optimizer per group) when the
        optimizer injects it, else ``{}``."""
        try:
            rates = self.model.state_access.learning_rates()
            return {
                "learning_rate" if group is None else f"learning_rate/{group}": rate for group, rate in rates.items()
            }
        except ValueError:  # the optimizer does not expose it (optimizers.require_learning_rate)
            return {}

    def _reading(self) -> dict[str, float]:
        step, now = _step(self.session), time.perf_counter()
        if self.meter is None or self._mark is None:
            self._mark = (step, now)
            return {}
        rates = self.meter.rates(step - self._mark[0], now - self._mark[1])
        self._mark = (step, now)
        return rates


#: Consecutive failures after which ``Logging`` drops a logger for the rest of the run.
MAX_FAILURES = 3


class Logging(_Rate):
    """Sends the logs to ``loggers`` (:class:`trainkit.monitoring.loggers.Logger` objects): at every epoch
    end (``update_freq="epoch"``) or every ``update_freq`` optimizer steps, the training
    metrics under run ``"train"`` and the validation metrics (without ``val_``) under
    ``"validation"``, at the global step; also the learning rate (when the optimizer injects
    it) and the throughput (examples/s, tokens/s with ``tokens_per_example``, TFLOP/s, and
    MFU where the device's peak is known). The run's hyperparameters are logged once, and at
    the end of ``fit`` the goodput ledger (``goodput``, ``goodput/<bucket>`` seconds; run ``"train"``).

    >>> import tempfile
    >>> cb = Logging([loggers.CSVMetricsLogger(tempfile.mkdtemp() + "/metrics.csv")], update_freq=10)
    >>> cb.update_freq
    10
    """

    def __init__(
        self,
        loggers_: list[loggers.Logger],
        update_freq: str | int = "epoch",
        tokens_per_example: int | None = None,
        close: bool = True,
    ):
        super().__init__(tokens_per_example)
        for item in loggers_:
            if not isinstance(item, loggers.Logger):
                raise TypeError(
                    f"{type(item).__name__} is not a logger: it needs log_metrics(step, metrics, run), "
                    "log_hparams(config) and close()."
                )
        if update_freq != "epoch" and (isinstance(update_freq, bool) or not isinstance(update_freq, int)):
            raise ValueError(f"update_freq must be 'epoch' or a positive number of steps; received {update_freq!r}.")
        self.loggers, self.update_freq, self.close_at_end = list(loggers_), update_freq, close
        self._failures: dict[int, int] = {}  # consecutive failures per logger

    def _call(self, item: loggers.Logger, method: Callable[..., object], *args: object) -> None:
        """One logger call, as a side effect: an error is warned about (naming the logger) and
        training and the other callbacks go on; a logger failing ``MAX_FAILURES`` times in a row
        is dropped for the rest of the run."""
        try:
            method(*args)
        except Exception as error:  # noqa: BLE001 - a logger's backend raises anything
            failures = self._failures[id(item)] = self._failures.get(id(item), 0) + 1
            dropped = failures >= MAX_FAILURES
            if dropped:
                self.loggers = [other for other in self.loggers if other is not item]
            reason = f"{type(error).__name__}: {redacted(str(error))}"  # a server's URL may carry a password
            warn_user(
                f"Logging: {type(item).__name__}.{method.__name__} failed ({reason}); "
                + ("training goes on" + (f", without this logger ({failures} failures in a row)." if dropped else "."))
            )
        else:
            self._failures[id(item)] = 0

    def _send(self, step: int, metrics: Logs, run: str) -> None:
        for item in list(self.loggers):
            self._call(item, item.log_metrics, step, metrics, run)

    def _extras(self) -> dict[str, float]:
        return {**self._reading(), **self._learning_rate()}

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self.meter, self._mark = None, None
        if distributed.is_main_process():
            config = run_config(self.model)
            for item in list(self.loggers):
                self._call(item, item.log_hparams, config)

    def reads_batch_logs(self) -> bool:
        return _due(self.session, self.update_freq)

    def execution_cap(self) -> int | None:
        return None if isinstance(self.update_freq, str) else self.update_freq

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        step = _step(self.session)
        if self.meter is None:
            self._start_meter()
            self._mark = (step, time.perf_counter())
        if not _due(self.session, self.update_freq):
            return
        if distributed.is_main_process():
            self._send(step, {**(logs or {}), **self._extras()}, "train")

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if not distributed.is_main_process():
            return
        train, validation = _split_runs(logs or {})
        step = self.model.global_step
        if self.update_freq == "epoch":
            self._send(step, {**train, **self._extras(), "epoch": epoch}, "train")
        if validation:
            self._send(step, validation, "validation")

    def on_train_end(self, logs: Logs | None = None) -> None:
        goodput = self.session.ledger.last  # the fit's goodput ledger, closed before this hook
        if goodput is not None and distributed.is_main_process():
            self._send(self.model.global_step, goodput.scalars(), "train")
        if self.close_at_end and distributed.is_main_process():
            for item in list(self.loggers):
                self._call(item, item.close)

    def on_exception(self, exception: BaseException) -> None:
        self.on_train_end()


class Profiler(Callback):
    """A ``jax.profiler`` trace of the optimizer steps ``steps=(first, last)`` (counted from 1,
    both included), written to ``log_dir`` (``plugins/profile/<run>/``: TensorBoard's profile
    plugin reads it; ``perfetto_trace.json.gz`` opens in ui.perfetto.dev). Each step is marked
    ``train`` with its ``step_num``. ``memory_profile=True`` also saves the device memory
    profile (pprof) at the last traced step. Only process 0 traces."""

    async_safe = False  # the trace must end after the last step ran
    annotates_steps = True

    def reads_batch_logs(self) -> bool:
        return False

    def __init__(self, log_dir: LocalPath, steps: tuple[int, int], memory_profile: bool = False):
        if (
            not isinstance(steps, (tuple, list))
            or len(steps) != 2
            or not all(isinstance(s, int) and s > 0 for s in steps)
            or steps[0] > steps[1]
        ):
            raise ValueError(f"steps must be (first, last) optimizer steps, 1 <= first <= last; received {steps!r}.")
        self.log_dir = require_local(log_dir, "Profiler's log_dir")
        self.steps, self.memory_profile = tuple(steps), memory_profile
        self.tracing = False

    def on_train_begin(self, logs: Logs | None = None) -> None:
        if distributed.is_main_process():  # an unwritable directory fails now, not at the first traced step
            loggers.check_log_dir(self.log_dir, "Profiler")

    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        record = self.session.require_record()  # the steps this batch (or execution) covers
        if record.first_step <= self.steps[0] <= record.step and not self.tracing and distributed.is_main_process():
            jax.profiler.start_trace(self.log_dir, create_perfetto_trace=True)
            self.tracing = True

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if self.tracing and self.model.global_step >= self.steps[1]:
            self._stop()

    def _stop(self) -> None:
        jax.block_until_ready(self.model.state)
        if self.memory_profile:
            jax.profiler.save_device_memory_profile(os.path.join(self.log_dir, "memory.prof"))
        jax.profiler.stop_trace()
        self.tracing = False

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self.tracing:
            self._stop()

    def on_exception(self, exception: BaseException) -> None:
        self.on_train_end()


class TensorBoard(_Rate):
    """Keras 3's ``TensorBoard`` callback, written with tensorboardX (no TensorFlow needed):
    ``log_dir/train`` and ``log_dir/validation`` runs with ``epoch_<metric>`` scalars at each
    epoch (``epoch_learning_rate`` too), ``batch_<metric>`` every ``update_freq`` steps
    (``"batch"``: every step), ``evaluation_<metric>_vs_iterations`` at each validation,
    parameter histograms every ``histogram_freq`` epochs, ``epoch_steps_per_second`` with
    ``write_steps_per_second``, and a profile of ``profile_batch=(first, last)``. trainkit adds
    ``epoch_examples_per_second`` (and TFLOP/s, MFU where known), the run's hyperparameters, and
    the goodput ledger's ``goodput`` and ``goodput/<bucket>`` seconds at the end of ``fit``.

    >>> TensorBoard("/tmp/logs", update_freq="batch").update_freq
    1
    """

    def __init__(
        self,
        log_dir: LocalPath = "logs",
        histogram_freq: int = 0,
        write_graph: bool = True,
        write_images: bool = False,
        write_steps_per_second: bool = False,
        update_freq: str | int = "epoch",
        profile_batch: int | tuple[int, int] = 0,
        tokens_per_example: int | None = None,
    ):
        super().__init__(tokens_per_example)
        self.log_dir = require_local(log_dir, "TensorBoard's log_dir")
        self.histogram_freq, self.write_graph, self.write_images = histogram_freq, write_graph, write_images
        self.write_steps_per_second = write_steps_per_second
        self.update_freq = 1 if update_freq == "batch" else update_freq
        if self.update_freq != "epoch" and (
            isinstance(self.update_freq, bool) or not isinstance(self.update_freq, int) or self.update_freq < 1
        ):
            raise ValueError(f"update_freq must be 'epoch', 'batch' or a positive integer; received {update_freq!r}.")
        if isinstance(profile_batch, int) and not isinstance(profile_batch, bool):
            profile_batch = (profile_batch, profile_batch) if profile_batch > 0 else (0, 0)
        # Keras profiles into the train run's directory: log_dir/train/plugins/profile/<time>/
        train_dir = os.path.join(self.log_dir, "train")
        steps = profile_batch if isinstance(profile_batch, tuple) else (0, 0)
        self.profiler = Profiler(train_dir, steps) if any(steps) else None
        self.async_safe = self.profiler is None  # a profiled step waits for its batch
        self.annotates_steps = self.profiler is not None
        self.board: loggers.TensorBoardLogger | None = None

    def reads_batch_logs(self) -> bool:
        return self.board is not None and _due(self.session, self.update_freq)

    def execution_cap(self) -> int | None:
        if self.profiler is not None:
            return 1
        return None if isinstance(self.update_freq, str) else self.update_freq

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self.meter, self._mark, self._epoch_mark = None, None, cast(tuple[int, float] | None, None)
        if self.profiler is not None:
            self.profiler.set_trainer(self.trainer)
        if distributed.is_main_process():
            self.board = loggers.TensorBoardLogger(self.log_dir)
            self.board.log_hparams(run_config(self.model))

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._epoch_mark = (self.model.global_step, time.perf_counter())

    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        if self.profiler is not None:
            self.profiler.on_train_batch_begin(batch, logs)

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if self.profiler is not None:
            self.profiler.on_train_batch_end(batch, logs)
        if self.meter is None:
            self._start_meter()
        step = _step(self.session)
        if self.board is not None and _due(self.session, self.update_freq):
            self.board.log_metrics(step, logs or {}, "train", prefix="batch_")

    def on_test_end(self, logs: Logs | None = None) -> None:
        if self.board is not None and logs:  # Keras's tag, at the optimizer step
            tagged = {f"evaluation_{name}_vs_iterations": value for name, value in logs.items()}
            self.board.log_metrics(self.model.global_step, tagged, "validation", prefix="")

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        self.histograms = None
        if self.histogram_freq and epoch % self.histogram_freq == 0:  # a gather: every process takes part
            self.histograms = _named_leaves(self.model.params)
        if self.board is None:
            return
        train, validation = _split_runs(logs or {})
        extras = self._learning_rate()
        if self.meter is not None and self._epoch_mark is not None:
            steps, seconds = self.model.global_step - self._epoch_mark[0], time.perf_counter() - self._epoch_mark[1]
            extras.update(self.meter.rates(steps, seconds))
            if self.write_steps_per_second and seconds > 0:
                extras["steps_per_second"] = steps / seconds
        self.board.log_metrics(epoch, {**train, **extras}, "train", prefix="epoch_")
        if validation:
            self.board.log_metrics(epoch, validation, "validation", prefix="epoch_")
        if self.histograms is not None:
            self.board.log_histograms(epoch, self.histograms, "train")

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self.profiler is not None:
            self.profiler.on_train_end(logs)
        goodput = self.session.ledger.last  # None after an exception
        if self.board is not None and goodput is not None:
            self.board.log_metrics(self.model.global_step, goodput.scalars(), "train", prefix="")
        if self.board is not None:
            self.board.close()
            self.board = None

    def on_exception(self, exception: BaseException) -> None:
        self.on_train_end()


def _named_leaves(params: Any) -> dict[str, np.ndarray]:
    """``Dense_0/kernel/histogram``-style names (Keras's ``{weight.path}/histogram``)."""
    named = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        named[f"{leaf_name(path)}/histogram"] = np.asarray(leaf)
    return named
