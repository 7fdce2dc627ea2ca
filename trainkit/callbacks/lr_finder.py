"""The learning-rate range test (Lightning's ``Tuner.lr_find``, after Smith 2015): train
``steps`` batches with the learning rate rising exponentially from ``min_lr`` to ``max_lr``,
smooth the loss, stop once it diverges, and suggest the rate where the smoothed loss falls
fastest. The trial runs through ``fit`` (the real train step, one batch per epoch so that each
loss logged is that batch's); afterwards the trainer's state, optimizer state, step count,
iterator position and history are exactly what they were.

>>> lrs = np.geomspace(1e-4, 1.0, 60)
>>> losses = 2.0 - np.tanh(np.log10(lrs / 1e-2) * 2)  # falls fastest at 1e-2
>>> smoothed = smooth(losses)
>>> bool(1e-3 < suggest(lrs, smoothed, skip_begin=10, skip_end=1) < 1e-1)
True
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypedDict

import numpy as np

from trainkit.callbacks.base import Callback, Logs
from trainkit.callbacks.trainer_view import TrainerView
from trainkit.core.local_path import LocalPath, require_local
from trainkit.core.state import TrainState
from trainkit.core.tree import PyTree
from trainkit.core.warn import warn_user

if TYPE_CHECKING:  # matplotlib is optional (the plot needs it)
    from matplotlib.figure import Figure
from trainkit.distributed import atomic

#: Lightning's defaults: the loss's smoothing, the divergence threshold, the points left out.
SMOOTHING, EARLY_STOP_THRESHOLD, SKIP_BEGIN, SKIP_END = 0.98, 4.0, 10, 1


#: Rates or losses, one per step of the range test.
Floats = Sequence[float] | np.ndarray


def smooth(losses: Floats, beta: float = SMOOTHING) -> np.ndarray:
    """An exponential moving average of ``losses``, corrected for its start at zero (Lightning's)."""
    average, out = 0.0, []
    for i, loss in enumerate(losses):
        average = beta * average + (1 - beta) * float(loss)
        out.append(average / (1 - beta ** (i + 1)))
    return np.asarray(out)


def _read(lrs: Floats, smoothed: Floats, skip_begin: int, skip_end: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The rates and smoothed losses a rule reads: the first ``skip_begin`` and last
    ``skip_end`` points left out, and the non-finite ones; ``None`` when fewer than two remain."""
    lrs, smoothed = np.asarray(lrs, np.float64), np.asarray(smoothed, np.float64)
    window = np.arange(skip_begin, max(skip_begin, len(lrs) - skip_end))
    window = window[np.isfinite(smoothed[window])]
    return None if len(window) < 2 else (lrs[window], smoothed[window])


def suggest(lrs: Floats, smoothed: Floats, skip_begin: int = SKIP_BEGIN, skip_end: int = SKIP_END) -> float | None:
    """The rate at the steepest descent of the smoothed loss (the most negative gradient over
    the log of the rate), the first ``skip_begin`` and last ``skip_end`` points left out;
    ``None`` when fewer than two finite points remain."""
    read = _read(lrs, smoothed, skip_begin, skip_end)
    if read is None:
        return None
    rates, losses = read
    return float(rates[int(np.argmin(np.gradient(losses, np.log(rates))))])


def minimum_over_ten(
    lrs: Floats, smoothed: Floats, skip_begin: int = SKIP_BEGIN, skip_end: int = SKIP_END
) -> float | None:
    """fastai's ``lr_min``: the rate of the lowest smoothed loss divided by 10 (an order of
    magnitude below where training stops improving), the same points left out as ``suggest``.

    >>> minimum_over_ten([1e-3, 1e-2, 1e-1, 1.0], [2.0, 1.0, 0.5, 3.0], skip_begin=0, skip_end=0)
    0.01
    """
    read = _read(lrs, smoothed, skip_begin, skip_end)
    if read is None:
        return None
    rates, losses = read
    return float(rates[int(np.argmin(losses))] / 10)


def valley(lrs: Floats, smoothed: Floats, skip_begin: int = SKIP_BEGIN, skip_end: int = SKIP_END) -> float | None:
    """fastai's default ``valley``: the longest stretch over which the smoothed loss keeps
    falling (a longest decreasing subsequence), and the rate two thirds of the way down it.

    >>> round(valley(np.geomspace(1e-4, 1, 9), [3, 3, 2.5, 2, 1.5, 1, 0.8, 2, 9], skip_begin=0, skip_end=0), 4)
    0.0032
    """
    read = _read(lrs, smoothed, skip_begin, skip_end)
    if read is None:
        return None
    rates, losses = read
    longest = [1] * len(losses)  # the longest falling run ending at each point
    end = 0
    for i in range(1, len(losses)):
        for j in range(i):
            if losses[i] < losses[j] and longest[i] < longest[j] + 1:
                longest[i] = longest[j] + 1
        if longest[end] < longest[i]:
            end = i
    start = max(end - longest[end], 0)  # as fastai counts it (not before the first point)
    third = (end - start) / 3
    return float(rates[start + int(third) + int(third / 2)])


#: The rules that turn a range test into one rate, by name; ``suggestion`` is ``RULE``'s. Measured
#: by ``benchmarks/lr_rules.py`` (docs/tuning.md): trained 5 epochs at each rule's rate, the digits
#: CNN and an MLP with Adam and SGD + momentum came within 0.015 of the best fixed rate's test
#: accuracy on average under "steep" (worst 0.044), 0.019 under "min/10" (worst 0.064) and 0.098
#: under "valley" (worst 0.306).
RULES = {"steep": suggest, "min/10": minimum_over_ten, "valley": valley}
RULE = "steep"


def suggest_by(rule: str, lrs: Floats, smoothed: Floats) -> float | None:
    """The suggestion of the named rule (:data:`RULES`) for a range test's rates and smoothed losses."""
    if rule not in RULES:
        raise ValueError(f"Unknown rule {rule!r}: pass one of {sorted(RULES)}.")
    return RULES[rule](lrs, smoothed)


@dataclasses.dataclass(frozen=True)
class LearningRateSearch:
    """What :meth:`trainkit.Trainer.find_learning_rate` found: the rates tried, the smoothed
    losses (``raw_losses``: each batch's), the ``suggestion`` (``None`` with too few points) and
    every rule's (``suggestions``: :data:`RULES`)."""

    lrs: list[float]
    losses: list[float]
    raw_losses: list[float]
    suggestion: float | None
    stopped_early: bool
    suggestions: dict[str, float | None] = dataclasses.field(default_factory=dict)

    def plot(self, path: LocalPath, suggest: bool = True) -> Figure:
        """The smoothed loss against the rate (log scale), the suggestion marked, as a PNG at
        ``path`` (matplotlib, the ``monitoring`` extra); returns the figure."""
        path = require_local(path, "LearningRateSearch.plot's path")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(6, 4))
        axis.plot(self.lrs, self.losses)
        axis.set_xscale("log")
        axis.set_xlabel("learning rate")
        axis.set_ylabel("loss (smoothed)")
        if suggest and self.suggestion is not None:
            index = self.lrs.index(self.suggestion)
            axis.plot(self.suggestion, self.losses[index], "o", color="red", label=f"suggestion {self.suggestion:.3g}")
            axis.legend()
        figure.tight_layout()
        with atomic.staged(path) as temporary:  # the old plot stays whole if this one fails
            figure.savefig(temporary, dpi=100)
        plt.close(figure)
        return figure


class RangeTest(Callback):
    """Sets each epoch's (one batch's) learning rate and reads its loss; stops at divergence."""

    def __init__(self, lrs: np.ndarray, early_stop_threshold: float | None, beta: float):
        super().__init__()
        self.lrs, self.threshold, self.beta = lrs, early_stop_threshold, beta
        self.raw: list[float] = []
        self.stopped_early = False

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self.model.state_access.set_learning_rate(float(self.lrs[epoch]))  # every group's, under several

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        self.raw.append(float((logs or {})["loss"]))
        smoothed = smooth(self.raw, self.beta)
        best = float(np.min(smoothed))
        if not math.isfinite(smoothed[-1]) or (
            self.threshold is not None and len(smoothed) > 1 and smoothed[-1] > self.threshold * best
        ):
            self.stopped_early = True
            self.model.stop_training = True


def iter_once(x: object) -> bool:
    """Whether ``x`` is a one-shot iterator (a generator, ``map``, ``iter(list)``): reading it
    consumes it.

    >>> iter_once(iter([1])), iter_once([1]), iter_once(None)
    (True, False, False)
    """
    return isinstance(x, collections.abc.Iterator)  # not iter(x): a loader's __iter__ may start workers


def no_suggestion(raw: list[float], tried: list[float], min_lr: float) -> str:
    """Why a range test suggests no rate, and what to do.

    >>> no_suggestion([float("nan")], [1e-7], 1e-7)[:59]
    'find_learning_rate suggests no rate: the loss was nan at th'
    """
    if raw and not math.isfinite(raw[0]):
        return (
            f"find_learning_rate suggests no rate: the loss was {raw[0]} at the first batch "
            f"(learning rate {min_lr:g}), before any rate could matter. A NaN or infinite loss "
            "from the start comes from the data or the loss (NaN in the inputs or targets, labels "
            "outside the classes, log of 0): check a batch with trainer.evaluate(x[:32], y[:32]) "
            "and np.isfinite(x).all()."
        )
    return (
        f"find_learning_rate suggests no rate: the loss diverged after {len(raw)} of the rates tried "
        f"(up to {tried[-1] if tried else min_lr:g}), too few to find the steepest descent. Lower min_lr, or raise "
        "steps= for more points."
    )


class RangeTested(TrainerView, Protocol):
    """What the range test drives of a trainer besides a callback's view: ``init`` and ``fit``."""

    def init(self, sample_batch: PyTree) -> TrainState: ...

    def fit(
        self, x: PyTree, y: PyTree, *, batch_size: int | None, epochs: int, steps_per_epoch: int, verbose: int,
        callbacks: list[Callback],
    ) -> object: ...  # fmt: skip


class RangeOptions(TypedDict, total=False):
    """``Trainer.find_learning_rate``'s options (:func:`find_learning_rate`'s defaults)."""

    min_lr: float
    max_lr: float
    steps: int
    early_stop_threshold: float | None


def find_learning_rate(
    trainer: RangeTested,
    x: PyTree,
    y: PyTree,
    *,
    batch_size: int | None,
    min_lr: float = 1e-7,
    max_lr: float = 1.0,
    steps: int = 100,
    early_stop_threshold: float | None = EARLY_STOP_THRESHOLD,
    smoothing: float = SMOOTHING,
) -> LearningRateSearch:
    """:meth:`trainkit.Trainer.find_learning_rate` on ``trainer`` (whose ``state_access.kept()`` puts
    its session and decisions back)."""
    if not 0 < min_lr < max_lr < math.inf:
        raise ValueError(f"Pass finite rates 0 < min_lr < max_lr; received min_lr={min_lr}, max_lr={max_lr}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps must be an integer of at least 2; received {steps!r}.")
    if iter_once(x):
        raise ValueError(
            f"find_learning_rate trains {steps} batches, which it would take from this one-shot iterator "
            f"({type(x).__name__}) for good: a later fit would miss them. Pass arrays, or a source that can be read "
            "again (a list of batches, a grain or Hugging Face dataset, an object whose __iter__ returns a fresh "
            "iterator)."
        )
    trainer.init(x if y is None else (x, y))
    trainer.state_access.require_settable_learning_rate()  # no inject_hyperparams, or a schedule: refused first
    lrs = np.geomspace(min_lr, max_lr, steps)
    test = RangeTest(lrs, early_stop_threshold, smoothing)
    with trainer.state_access.kept(), warnings.catch_warnings():  # the session and the setup's decisions put back
        # a diverging loss ends the search (stopped_early), not "training goes on" as the loop says of a fit
        warnings.filterwarnings("ignore", message=r"The loss is .* training goes on")
        trainer.fit(x, y, batch_size=batch_size, epochs=steps, steps_per_epoch=1, verbose=0, callbacks=[test])
    tried = [float(lr) for lr in lrs[: len(test.raw)]]
    smoothed = smooth(test.raw, smoothing)
    suggestions = {rule: suggest_by(rule, tried, smoothed) for rule in RULES}
    losses = [float(v) for v in smoothed]
    if suggestions[RULE] is None:
        warn_user(no_suggestion(test.raw, tried, min_lr))
    return LearningRateSearch(tried, losses, test.raw, suggestions[RULE], test.stopped_early, suggestions)
