"""Spike skipping as a step feature: an update whose loss (or gradient norm) spikes above the
state's running average is not applied (``Trainer(skip_spikes=tk.SkipSpikes(...))``; the
decision and its report are :class:`~trainkit.core.spikes.SpikeSkip`'s).

>>> from trainkit.core.spikes import SpikeSkip
>>> callable(skip_spikes(SpikeSkip()))
True
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from trainkit.core.spikes import SPIKES, SpikeSkip
from trainkit.core.step_feature import StepFeature, StepUpdate


def skip_spikes(spike_skip: SpikeSkip) -> StepFeature:
    """The feature: the step's parameters, optimizer and model state kept as they were when
    it spikes (the same choice as the loss scale's, on the loss or the gradient norm); the
    spike average after it, and the step's :class:`~trainkit.core.spikes.SpikeReport`."""

    def feature(update: StepUpdate) -> StepUpdate:
        before, after = update.before, update.after
        watched = update.metrics["loss"].compute() if spike_skip.on == "loss" else optax.tree.norm(update.grads)
        spike, spikes = spike_skip.decide(before.spikes, watched)
        old = (before.params, before.opt_state, before.model_state)
        new = (after.params, after.opt_state, after.model_state)
        params, opt_state, model_state = jax.tree.map(lambda was, now: jnp.where(spike, was, now), old, new)
        after = after.replace(params=params, opt_state=opt_state, model_state=model_state, spikes=spikes)
        report = spike_skip.report(spike, before.step + 1, watched, before.spikes)
        return dataclasses.replace(update.with_metrics(**{SPIKES: report}), after=after)

    return feature
