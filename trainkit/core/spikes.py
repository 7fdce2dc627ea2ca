"""Loss-spike skipping inside the train step: an update whose loss (or gradient norm) exceeds
``factor`` times its running average is not applied, as a non-finite fp16 step is not (the
parameters, optimizer moments and model state kept). The running average lives in the
``TrainState`` (``state.spikes``), so a resumed run decides exactly as an uninterrupted one.

>>> import jax.numpy as jnp
>>> skip = SpikeSkip(factor=3.0, window=4, warmup=2)
>>> state, decisions = skip.initial(), []
>>> for loss in [1.0, 1.2, 0.9, 9.0, 1.1]:
...     spike, state = skip.decide(state, jnp.float32(loss))
...     decisions.append(bool(spike))
>>> decisions, int(state.skipped), round(float(state.mean), 3)
([False, False, False, True, False], 1, 1.05)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Self

import clu.metrics
import flax.struct
import jax
import jax.numpy as jnp

#: the metric under which the step reports its skipped updates (hidden: ``_``)
SPIKES = "_spikes"


@flax.struct.dataclass
class SpikeState:
    """The running average a :class:`SpikeSkip` compares with, in the ``TrainState``: its value,
    the steps it has seen (skipped ones excluded), the updates skipped in a row and in all."""

    if TYPE_CHECKING:  # flax.struct.dataclass adds it

        def replace(self, **changes: object) -> Self: ...

    mean: jax.Array
    seen: jax.Array
    in_a_row: jax.Array
    skipped: jax.Array


@flax.struct.dataclass
class SpikeReport(clu.metrics.Metric):
    """The skipped updates of the steps merged (an epoch's): how many, the first one's step,
    value and running average, the longest run of skips in a row (``count == 0``: none), and
    the step at which a run first reached ``stop_after`` (0: none did)."""

    count: jax.Array
    step: jax.Array
    value: jax.Array
    mean: jax.Array
    longest: jax.Array
    stop: jax.Array

    def merge(self, other: SpikeReport) -> SpikeReport:
        first = self.count > 0
        keep = lambda mine, theirs: jnp.where(first, mine, theirs)  # noqa: E731
        return SpikeReport(
            self.count + other.count,
            keep(self.step, other.step),
            keep(self.value, other.value),
            keep(self.mean, other.mean),
            jnp.maximum(self.longest, other.longest),
            jnp.where(self.stop > 0, self.stop, other.stop),
        )

    def compute(self) -> jax.Array:
        return self.count


@dataclasses.dataclass(frozen=True)
class SpikeSkip:
    """Skips an update whose ``on`` (``"loss"``: the step's mean loss over the global batch, or
    ``"grad_norm"``: the global gradient norm) exceeds ``factor`` times its running average, or
    is not finite. The average is the mean of the steps seen so far, then (past ``window``
    steps) an exponential average over about ``window`` steps; skipped steps are not averaged
    in. Nothing is skipped before ``warmup`` steps were seen (default: ``window // 10``, at
    least 1). ``stop_after`` skips in a row stop ``fit`` with an error: the model is no longer
    training.

    ``Trainer(skip_spikes=tk.SpikeSkip(factor=4.0, window=100))``; a skipped step still counts
    as an optimizer step (its number, the data position and the epoch move on), its loss is
    still logged, and ``fit`` reports each epoch's skips (how many, the first one's step and
    batch, its value and the average) on the ``trainkit`` logger at WARNING.
    """

    factor: float = 4.0
    window: int = 100
    on: str = "loss"
    warmup: int | None = None
    stop_after: int = 10

    def __post_init__(self) -> None:
        if not self.factor > 1:
            raise ValueError(f"SpikeSkip(factor={self.factor!r}): it must be above 1 (a spike exceeds the average).")
        counted = [("window", self.window), ("stop_after", self.stop_after)]
        for name, value in counted + ([("warmup", self.warmup)] if self.warmup is not None else []):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"SpikeSkip({name}={value!r}): it must be a positive number of steps"
                    + (" (the first step's value is measured before any is compared)." if name == "warmup" else ".")
                )
        if self.on not in ("loss", "grad_norm"):
            raise ValueError(f"SpikeSkip(on={self.on!r}): it watches 'loss' or 'grad_norm'.")

    @property
    def first_decision(self) -> int:
        """Steps seen before any is skipped."""
        return self.warmup if self.warmup is not None else max(1, self.window // 10)

    def initial(self) -> SpikeState:
        """The state at step 0: nothing seen."""
        return SpikeState(jnp.float32(0), jnp.int32(0), jnp.int32(0), jnp.int32(0))

    def decide(self, state: SpikeState, value: jax.Array) -> tuple[jax.Array, SpikeState]:
        """Whether the update with this ``value`` is skipped, and the state after it."""
        value = value.astype(jnp.float32)
        ready = state.seen >= max(1, self.first_decision)  # a first value is never a spike: no average yet
        spike = ~jnp.isfinite(value) | (ready & (value > self.factor * state.mean))
        weight = 1.0 / jnp.minimum(state.seen + 1, self.window).astype(jnp.float32)
        mean = jnp.where(spike, state.mean, state.mean + (value - state.mean) * weight)
        new = SpikeState(
            mean=mean,
            seen=state.seen + jnp.where(spike, 0, 1).astype(jnp.int32),
            in_a_row=jnp.where(spike, state.in_a_row + 1, 0).astype(jnp.int32),
            skipped=state.skipped + spike.astype(jnp.int32),
        )
        return spike, new

    def report(self, spike: jax.Array, step: jax.Array, value: jax.Array, state: SpikeState) -> SpikeReport:
        """The step's :class:`SpikeReport` (``state``: the one it was compared with)."""
        hit, run = spike.astype(jnp.int32), jnp.where(spike, state.in_a_row + 1, 0).astype(jnp.int32)
        return SpikeReport(
            hit,
            jnp.where(spike, step, 0).astype(jnp.int32),
            jnp.where(spike, value, 0).astype(jnp.float32),
            jnp.where(spike, state.mean, 0).astype(jnp.float32),
            run,
            jnp.where(run >= self.stop_after, step, 0).astype(jnp.int32),
        )


def reported(report: SpikeReport, where: str, watched: str = "loss") -> tuple[str | None, str | None]:
    """``(warning, error)`` for an epoch's host :class:`SpikeReport`: what to log about its
    skipped updates (``where``: the first one's batch and epoch), and the error that stops the
    run once a run of skips reached ``stop_after`` (``None``: nothing to say)."""
    if not int(report.count):
        return None, None
    warning = (
        f"SpikeSkip: {int(report.count)} update(s) skipped as spikes; the first at step {int(report.step)} "
        f"({where}): {watched} {float(report.value):.4g} against a running average of {float(report.mean):.4g}."
    )
    if not int(report.stop):
        return warning, None
    error = (
        f"SpikeSkip: {int(report.longest)} updates in a row, up to step {int(report.stop)}, were skipped as spikes "
        f"(the first this epoch: {watched} {float(report.value):.4g} against a running average of "
        f"{float(report.mean):.4g}): the model is no longer training. Lower the learning rate, look at the data "
        "of those batches, or raise SpikeSkip(factor=...) or stop_after=; the state is that of the last applied "
        "update."
    )
    return warning, error
