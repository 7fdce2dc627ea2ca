"""MFU for the progress bar and the goodput summary: a train step's flops (the lowered step's:
the model's own operations, remat's recomputation included) over the peak of the devices that
run it, where the peak is known (an accelerator in :data:`~.throughput.PEAK_FLOPS`; a CPU has
none, and then nothing is lowered).

>>> at_median(0.5, 0.2), at_median(None, 0.2), at_median(0.5, None)
('\\nMFU 40.0% at the median step.', '', '')
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from numpy.typing import DTypeLike

from trainkit.monitoring import debug, throughput

logger = logging.getLogger("trainkit")


def per_step(trainer: debug.CompiledTrainer, compute_dtype: DTypeLike) -> float | None:
    """The MFU of one step per second: the step's flops over the peak of all its devices at
    ``compute_dtype`` (``None``: the peak or the flops unknown)."""
    devices = jax.devices()
    precision = np.dtype(compute_dtype).name
    peak = throughput.peak_flops(devices[0].device_kind, precision)
    if peak is None:
        return None
    try:
        flops = debug.step_flops(trainer)
    except Exception:  # noqa: BLE001 - a strategy whose step cannot be lowered: no MFU shown
        logger.info("progress: the train step's flops are unknown; no MFU.", exc_info=True)
        return None
    return None if flops is None else flops / (peak * len(devices))


def at_median(step_median: float | None, mfu_per_step: float | None) -> str:
    """The goodput summary's MFU line at the median step time ("" where either is unknown)."""
    if not step_median or not mfu_per_step:
        return ""
    return f"\nMFU {mfu_per_step / step_median:.1%} at the median step."
