"""``ProgressBar``: a rich progress bar per epoch with ETA, steps/s and running metrics.

>>> bar = ProgressBar(verbose=0)   # verbose=0 prints nothing
>>> bar.set_params({"verbose": 1, "epochs": 2, "steps": 4})
>>> bar.on_train_begin(); bar.on_epoch_begin(0); bar.on_epoch_end(0, {"loss": 1.0})
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Column
from rich.text import Text

from trainkit.callbacks.base import Callback, Logs, RunParams
from trainkit.monitoring import utilisation
from trainkit.monitoring.goodput import report as goodput_report

#: Seconds between two redraws of the live bar (rich's ``Live`` refreshes at about the same rate).
REFRESH_SECONDS = 0.1


#: Console widths from which the live bar shows its elapsed time and examples/s (``WIDE``), and
#: its steps/s (``MEDIUM``); narrower, the bar, the step counter, the ETA and the metrics only.
WIDE, MEDIUM = 120, 100


def keras_value(value: float) -> str:
    """A logged value as Keras's progress bar prints it: four decimals, or four significant
    digits in exponent form at 1e-3 and below.

    >>> keras_value(0.69314), keras_value(0.00012345)
    ('0.6931', '1.2345e-04')
    """
    return f"{value:.4f}" if value > 1e-3 else f"{value:.4e}"


def format_logs(logs: Logs | None) -> str:
    """``loss: 0.6931 - accuracy: 0.5000``: the live bar's and the epoch line's digits, the
    same as ``verbose=2`` prints (and Keras). Per-module values (a ``/`` in the name:
    ``GradientStats``' ``grad_norm/Dense_0``) stay in the logs, off the line.

    >>> format_logs({"loss": 0.25, "grad_norm": 1.5, "grad_norm/Dense_0": 1.0})
    'loss: 0.2500 - grad_norm: 1.5000'
    """
    return " - ".join(f"{k}: {keras_value(v)}" for k, v in (logs or {}).items() if "/" not in k)


class _Rate(TextColumn):
    """``12.3 steps/s, 197 examples/s``. While the epoch runs on a narrower console, the examples/s
    (``examples=False``) or the whole rate (``live=False``) give way to the metrics; the epoch's
    last frame, without metrics, shows it all."""

    def __init__(self, examples: bool = True, live: bool = True):
        super().__init__("")
        self.examples, self.live = examples, live

    def render(self, task) -> Text:
        if not task.finished and not self.live:
            return Text("")
        speed, batch, k = task.finished_speed or task.speed, task.fields.get("batch"), task.fields.get("k")
        shown = batch if self.examples or task.finished else None
        text = f"{speed:.1f} steps/s" + (f", {speed * shown:,.0f} examples/s" if shown else "") if speed else ""
        text += f" ({k} steps per call)" if text and k and k > 1 and shown else ""
        per_step = task.fields.get("mfu_per_step")  # utilisation.Utilisation of one step per second (a known peak)
        text += per_step.shown(speed) if text and per_step else ""
        return Text(text, style="progress.data.speed")


class _Elapsed(TimeElapsedColumn):
    """The epoch's elapsed time; on a narrow console (``live=False``) only in its last frame."""

    def __init__(self, live: bool = True):
        super().__init__()
        self.live = live

    def render(self, task) -> Text:
        return super().render(task) if task.finished or self.live else Text("")


def bar_columns(width: int) -> list[ProgressColumn]:
    """The live bar's columns for a console ``width`` columns wide: the epoch, the bar, the
    step counter, the ETA and the metrics always; while the epoch runs, the elapsed time from
    ``WIDE`` columns and the rate from ``MEDIUM`` (its examples/s from ``WIDE``), so that the
    metrics keep their room; the last frame (no metrics) shows the time and the rate."""
    metrics = Column(no_wrap=True, overflow="ellipsis", ratio=1)
    return [
        TextColumn("[bold]{task.description}", table_column=Column(no_wrap=True)),
        BarColumn(bar_width=20 if width >= MEDIUM else 12),
        MofNCompleteColumn(table_column=Column(no_wrap=True)),
        _Elapsed(live=width >= WIDE),
        _Remaining(),
        _Rate(examples=width >= WIDE, live=width >= MEDIUM),
        TextColumn("{task.fields[metrics]}", markup=False, table_column=metrics),
    ]


class _Remaining(TimeRemainingColumn):
    """``eta 0:00:03`` while the epoch runs; nothing once it is done (the last frame, all a log
    file that is not a terminal receives, then reads as Keras's: steps, elapsed time, speed)."""

    def render(self, task) -> Text:
        return Text("") if task.finished else Text.assemble("eta ", super().render(task))


class ProgressBar(Callback):
    """Shown by ``fit`` when ``verbose=1`` (the default). ``verbose=2`` prints one line per
    epoch instead of a live bar; ``verbose=0`` prints nothing. ``ProgbarLogger`` is its Keras
    name; like Keras's, it takes ``verbose`` from ``fit`` when not given.

    Args:
        verbose: 0, 1 or 2 as in Keras (``None``: ``fit``'s ``verbose``).
        console: a ``rich.console.Console`` to draw on (stdout by default).
    """

    async_safe = True  # it only draws the logs it is given

    def __init__(self, verbose: int | None = None, console: Console | None = None):
        self.verbose = verbose
        self.console = console
        self._progress: Progress | None = None
        self._task: TaskID | None = None  # the running epoch's bar
        self._epochs: int | None = None
        self._steps: int | None = None
        self._seen, self._next_draw = 0, 0.0  # batches done this epoch; when the bar redraws next
        self._started = 0.0  # the epoch's start
        self._after_first: tuple[int, float] | None = None  # (batches, time) after its first
        self._mfu_per_step: utilisation.Utilisation | None = None  # a step's flops over the peak (None: unknown)
        self._mfu_asked = False  # this fit's step lowered for its flops (once its batch is known)

    def set_params(self, params: RunParams | None) -> None:
        super().set_params(params)
        params = params or RunParams()
        if self.verbose is None:
            self.verbose = 1 if params.get("verbose", 1) == "auto" else int(params.get("verbose", 1))
        self._epochs, self._steps = params.get("epochs"), params.get("steps")

    def on_train_begin(self, logs: Logs | None = None) -> None:
        if self.verbose:
            self.console = self.console or Console()
            self._mfu_per_step, self._mfu_asked = None, False

    def _describe(self, epoch: int) -> str:
        return f"Epoch {epoch + 1}/{self._epochs}" if self._epochs else f"Epoch {epoch + 1}"

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._seen, self._started, self._after_first = 0, time.monotonic(), None
        if self.verbose == 2 and self.console is not None:  # Keras's two lines: this one, then the epoch's
            if self._epochs is None or self._epochs > 1:
                self.console.print(self._describe(epoch), highlight=False)
        if self.verbose != 1:
            return
        # One live bar per epoch: when it stops, its last frame stays above the next epoch's.
        console = self.console or Console()
        self._progress = Progress(*bar_columns(console.width), console=console, refresh_per_second=8)
        total = self._steps
        batch = self.session.batch_size if self.trainer is not None else None
        self._task = self._progress.add_task(
            self._describe(epoch), total=total, metrics="", batch=batch, mfu_per_step=self._mfu_per_step
        )
        self._seen, self._next_draw = 0, 0.0  # the first batch draws at once
        self._progress.start()

    def reads_batch_logs(self) -> bool:
        return self._progress is not None and time.monotonic() >= self._next_draw

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Redraws at most every ``REFRESH_SECONDS`` (the logs are read from the device only
        then); in between it only counts the batch."""
        self._seen = batch + 1
        if self._after_first is None:  # Keras's time per step leaves the first (compiling) step out
            self._after_first = (self._seen, time.monotonic())
        if self._progress is None or self._task is None or not logs:
            return
        now = time.monotonic()
        if now < self._next_draw:
            return
        self._next_draw = now + REFRESH_SECONDS
        k = self.model.steps_per_execution if self.trainer is not None else None  # "auto" picks it
        mfu = self._mfu()
        self._progress.update(self._task, completed=self._seen, metrics=format_logs(logs), k=k, mfu_per_step=mfu)

    def _mfu(self) -> utilisation.Utilisation | None:
        """MFU and HFU of one step per second, where the device's peak is known: the model traced
        and the step lowered once per fit, after its first batch (whose shapes they need)."""
        if not self._mfu_asked and self.trainer is not None and self.session.batch_spec is not None:
            self._mfu_asked = True
            self._mfu_per_step = utilisation.per_step(self.model, self.model.precision.compute_dtype)
        return self._mfu_per_step

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=self._seen, total=self._seen, metrics="")
            self._progress.stop()
            self._progress = None
            (self.console or Console()).print(f"  {format_logs(logs)}", highlight=False, soft_wrap=True)
        elif self.verbose == 2 and self.console is not None:
            self.console.print(self._keras_line(logs), highlight=False, soft_wrap=True)

    def _keras_line(self, logs: Logs | None) -> str:
        """Keras's ``verbose=2`` epoch line: ``11/11 - 4s - 395ms/step - loss: 0.6931 - ...``."""
        now, seen = time.monotonic(), self._seen
        target = self._steps or seen
        first_seen, first_at = self._after_first or (0, self._started)
        per_step = (now - first_at) / (seen - first_seen) if seen > first_seen else (now - self._started) / max(seen, 1)
        if per_step >= 1 or per_step == 0:
            pace = f"{per_step:.0f}s/step"
        elif per_step >= 1e-3:
            pace = f"{per_step * 1e3:.0f}ms/step"
        else:
            pace = f"{per_step * 1e6:.0f}us/step"
        digits = len(str(target))
        line = f"{seen:{digits}d}/{target} - {now - self._started:.0f}s - {pace}"
        return f"{line} - {format_logs(logs)}" if logs else line

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._progress is not None:  # stopped mid-epoch
            self._progress.stop()
            self._progress = None
        goodput = self.session.ledger.last if self.trainer is not None else None
        if self.verbose and goodput is not None:
            counted = self._mfu()
            mfu = "" if counted is None else counted.at_median(goodput.step_median)
            (self.console or Console()).print(goodput_report(goodput) + mfu, highlight=False, soft_wrap=True)

    def on_exception(self, exception: BaseException) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


#: Keras's name for the progress bar.
ProgbarLogger = ProgressBar
