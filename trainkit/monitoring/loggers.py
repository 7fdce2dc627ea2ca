"""Experiment loggers: a three-method protocol and its TensorBoard, CSV, MLflow and Weights &
Biases implementations. ``tk.callbacks.Logging(loggers)`` (or ``tk.callbacks.TensorBoard``)
feeds them from ``fit``; only process 0 writes.

Another backend is a class with the three methods:

>>> class Printer:
...     def log_metrics(self, step, metrics, run="train"):
...         print(run, step, metrics)
...     def log_hparams(self, config):
...         pass
...     def close(self):
...         pass
>>> isinstance(Printer(), Logger)
True
>>> Printer().log_metrics(3, {"loss": 0.5})
train 3 {'loss': 0.5}
"""

from __future__ import annotations

import csv
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import IO, TYPE_CHECKING, Any, Literal, Protocol, TypeVar, runtime_checkable

import numpy as np

from trainkit.core.local_path import LocalPath, require_local
from trainkit.core.redact import redacted
from trainkit.distributed import atomic, filesystem

if TYPE_CHECKING:  # optional packages, read by the type checker only
    from mlflow.tracking import MlflowClient
    from tensorboardX import SummaryWriter

T = TypeVar("T")
#: A run's hyperparameters as the loggers record them (``tk.callbacks.monitoring.run_config``).
RunConfig = dict[str, str | int | float | bool | None]

#: The runs a metric belongs to: training, or validation (Keras's TensorBoard subdirectories).
RUNS = ("train", "validation")


@runtime_checkable
class Logger(Protocol):
    """What ``tk.callbacks.Logging`` calls: ``log_metrics(step, metrics, run)`` with ``run``
    ``"train"`` or ``"validation"`` (metric names without the ``val_`` prefix),
    ``log_hparams(config)`` once per ``fit`` (a flat dict of numbers and strings), ``close()``
    at the end of ``fit``."""

    def log_metrics(self, step: int, metrics: dict[str, float], run: str = "train") -> None: ...

    def log_hparams(self, config: RunConfig) -> None: ...

    def close(self) -> None: ...


def check_log_dir(log_dir: LocalPath, owner: str) -> None:
    """Creates ``log_dir`` and writes a file in it, or raises a ``ValueError`` naming it and
    ``owner`` (called at ``on_train_begin``, so nothing fails in the middle of a run).

    >>> import tempfile
    >>> check_log_dir(tempfile.mkdtemp(), "Profiler")
    """
    problem = filesystem.write_problem(log_dir)
    if problem is not None:
        raise ValueError(
            f"{owner}: the log directory {os.fspath(log_dir)!r} cannot be written ({problem}); pass a writable log_dir."
        )


def _scalars(metrics: Mapping[str, float | np.ndarray]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0 and np.isfinite(float(v))}


class TensorBoardLogger:
    """Event files readable by TensorBoard, written with tensorboardX (no TensorFlow): one
    writer per run, in ``log_dir/train`` and ``log_dir/validation`` as Keras lays them out;
    scalars are tagged ``{prefix}{name}`` (Keras: ``epoch_loss``). Histograms via
    :meth:`log_histograms`, hyperparameters with TensorBoard's HParams plugin."""

    def __init__(self, log_dir: LocalPath, prefix: str = ""):
        from tensorboardX import SummaryWriter

        self.log_dir, self.prefix = require_local(log_dir, "TensorBoardLogger's log_dir"), prefix
        filesystem.require_folder(log_dir, "TensorBoard's log_dir")
        self._writer_class = SummaryWriter
        self._writers: dict[str, SummaryWriter] = {}

    def writer(self, run: str) -> SummaryWriter:
        if run not in self._writers:
            self._writers[run] = self._writer_class(os.path.join(self.log_dir, run))
        return self._writers[run]

    def log_metrics(self, step: int, metrics: dict[str, float], run: str = "train", prefix: str | None = None) -> None:
        writer = self.writer(run)
        for name, value in _scalars(metrics).items():
            writer.add_scalar(f"{self.prefix if prefix is None else prefix}{name}", value, global_step=step)
        writer.flush()

    def log_histograms(self, step: int, arrays: dict[str, np.ndarray], run: str = "train") -> None:
        writer = self.writer(run)
        for name, values in arrays.items():
            writer.add_histogram(name, np.asarray(values, np.float32), global_step=step)
        writer.flush()

    def log_hparams(self, config: RunConfig) -> None:
        self.writer("train").add_text("hparams", json.dumps(config, indent=1, default=str), global_step=0)
        self.writer("train").add_hparams(
            {k: v for k, v in config.items() if isinstance(v, (int, float, str, bool))}, {}, name="hparams"
        )

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers = {}


class CSVMetricsLogger:
    """Long-format CSV, one row per value: ``step,run,name,value`` (any metric at any step),
    and ``hparams.json`` beside it."""

    def __init__(self, path: LocalPath):
        self.path = require_local(path, "CSVMetricsLogger's path")
        self._file: IO[str] | None = None

    def _opened(self) -> IO[str]:
        if self._file is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "w", newline="")
            csv.writer(self._file).writerow(["step", "run", "name", "value"])
        return self._file

    def log_metrics(self, step: int, metrics: dict[str, float], run: str = "train") -> None:
        file = self._opened()
        rows = csv.writer(file)
        for name, value in _scalars(metrics).items():
            rows.writerow([step, run, name, repr(value)])
        file.flush()

    def log_hparams(self, config: RunConfig) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        atomic.write_text(os.path.join(directory, "hparams.json"), json.dumps(config, indent=1, default=str))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def bounded(call: Callable[[], T], seconds: float, what: str) -> T:
    """``call()``, or a ``TimeoutError`` naming ``what`` when it has not returned within
    ``seconds`` (it goes on in a daemon thread: a client waiting on a server cannot be stopped).

    >>> bounded(lambda: 4, 1.0, "a sum")
    4
    """
    import threading

    result: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(error)

    thread = threading.Thread(target=run, name="trainkit-bounded", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {seconds:g} s.")
    if errors:
        raise errors[0]
    return result[0]


class _Redacting(logging.Filter):
    """Masks the credentials in a library's log records (urllib3's retries quote the URL they retry)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = redacted(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True


#: the loggers of the libraries a tracking logger talks through, whose records may quote a URL with its token
LIBRARY_LOGGERS = ("urllib3.connectionpool", "urllib3.util.retry", "urllib3", "mlflow", "wandb")


def mask_library_logs() -> None:
    """Adds one :class:`_Redacting` filter to each of :data:`LIBRARY_LOGGERS` (once)."""
    for name in LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        if not any(isinstance(existing, _Redacting) for existing in library.filters):
            library.addFilter(_Redacting())


class MLflowLogger:
    """An MLflow run (``pip install mlflow``), in ``tracking_uri`` (a ``sqlite:///runs.db``
    database or a server; mlflow 3 no longer takes a ``file:`` directory for runs). Validation
    metrics are named ``val_<name>``, as in the logs; hyperparameters are the run's params.
    Every call to MLflow waits at most ``timeout`` seconds (its own retries to an unreachable
    server take minutes): the constructor raises then, and ``tk.callbacks.Logging`` warns and
    goes on without the run."""

    def __init__(
        self, tracking_uri: str, experiment: str = "trainkit", run_name: str | None = None, timeout: float = 30.0
    ):
        self.tracking_uri, self.timeout = tracking_uri, float(timeout)
        mask_library_logs()  # urllib3's retry warnings quote the URL, its ?token= too

        def start() -> tuple[MlflowClient, str]:
            import mlflow

            client = mlflow.tracking.MlflowClient(tracking_uri=tracking_uri)
            found = client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else client.create_experiment(experiment)
            return client, client.create_run(experiment_id, run_name=run_name).info.run_id

        self._client, self.run_id = self._bounded(start, "starting the run")

    def _bounded(self, call: Callable[[], T], what: str) -> T:
        """``call()`` within the timeout; its errors, which quote the server's URL, raised with the
        URL's credentials masked (and without the original's traceback, which would print them)."""
        where = f"MLflow at {redacted(repr(self.tracking_uri))} ({what})"
        try:
            return bounded(call, self.timeout, where)
        except TimeoutError:
            raise
        except Exception as error:  # noqa: BLE001 - mlflow raises many kinds
            raise RuntimeError(f"{where} failed: {type(error).__name__}: {redacted(str(error))}") from None

    def log_metrics(self, step: int, metrics: dict[str, float], run: str = "train") -> None:
        from mlflow.entities import Metric

        now = int(__import__("time").time() * 1000)
        prefix = "val_" if run == "validation" else ""
        batch = [Metric(f"{prefix}{k}", v, now, step) for k, v in _scalars(metrics).items()]
        if batch:
            self._bounded(lambda: self._client.log_batch(self.run_id, metrics=batch), "logging metrics")

    def log_hparams(self, config: RunConfig) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:500]) for k, v in config.items()]
        self._bounded(lambda: self._client.log_batch(self.run_id, params=params), "logging params")

    def close(self) -> None:
        self._bounded(lambda: self._client.set_terminated(self.run_id), "ending the run")


class WandbLogger:
    """A Weights & Biases run (``pip install wandb``), offline by default (files under
    ``dir/wandb``, uploaded later with ``wandb sync``). Validation metrics are ``val_<name>``.
    Online, starting the run waits at most ``timeout`` seconds for the server (wandb's
    ``init_timeout``, unless ``settings=`` says otherwise); a failure is raised with the
    server's credentials masked."""

    def __init__(
        self,
        project: str = "trainkit",
        dir: LocalPath = ".",
        mode: Literal["online", "offline", "disabled", "shared"] = "offline",
        timeout: float = 30.0,
        **init: Any,  # wandb.init's other keywords, passed as given
    ):
        import wandb

        mask_library_logs()
        folder = require_local(dir, "WandbLogger's dir")
        init.setdefault("settings", wandb.Settings(init_timeout=float(timeout)))
        try:
            self.run = wandb.init(project=project, dir=folder, mode=mode, reinit="create_new", **init)
        except Exception as error:  # noqa: BLE001 - wandb raises many kinds; its text may quote the server's URL
            raise RuntimeError(
                f"W&B ({mode}) could not start the run: {type(error).__name__}: {redacted(str(error))}"
            ) from None

    def log_metrics(self, step: int, metrics: dict[str, float], run: str = "train") -> None:
        prefix = "val_" if run == "validation" else ""
        self.run.log({f"{prefix}{k}": v for k, v in _scalars(metrics).items()}, step=step)

    def log_hparams(self, config: RunConfig) -> None:
        self.run.config.update(config, allow_val_change=True)

    def close(self) -> None:
        self.run.finish()
