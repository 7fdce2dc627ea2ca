"""MFU for the progress bar and the goodput summary: the share of the devices' peak a step per
second uses, counted two ways (where the peak is known: an accelerator in
:data:`trainkit.core.chips.CHIPS`; a CPU has none, and then nothing is traced or lowered). **MFU**
counts the model's own flops (:func:`~trainkit.monitoring.debug.model_step_flops`: its matrix
multiplies, three times the forward's, causal attention halved), as MaxText and PaLM do, so remat
does not inflate it; **HFU** the lowered step's flops (the compiler's count: remat's recomputation
in, a Pallas kernel out).

>>> Utilisation(model=0.5, hardware=0.6).shown(steps_per_second=0.8)
', MFU 40.0% (HFU 48.0%)'
>>> Utilisation(model=0.5, hardware=0.6).at_median(0.5)
'\\nMFU 100.0% at the median step (HFU 120.0%).'
>>> Utilisation(model=None, hardware=0.6).shown(1.0), Utilisation(None, None).at_median(0.5)
(', HFU 60.0%', '')
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import jax
import numpy as np
from numpy.typing import DTypeLike

from trainkit.monitoring import debug, throughput

logger = logging.getLogger("trainkit")


@dataclasses.dataclass(frozen=True)
class Utilisation:
    """The share of the devices' peak one step per second uses: ``model`` by the model's own flops
    (MFU), ``hardware`` by the compiler's count of the lowered step (HFU); ``None`` where unknown."""

    model: float | None
    hardware: float | None

    def shown(self, steps_per_second: float) -> str:
        """``", MFU 41.2% (HFU 49.8%)"`` at ``steps_per_second`` (``""`` where neither is known)."""
        model, hardware = (None if v is None else v * steps_per_second for v in (self.model, self.hardware))
        if model is None:
            return "" if hardware is None else f", HFU {hardware:.1%}"
        return f", MFU {model:.1%}" + ("" if hardware is None else f" (HFU {hardware:.1%})")

    def at_median(self, step_median: float | None) -> str:
        """The goodput summary's line at the median step time (``""`` where unknown)."""
        if not step_median or self.model is None:
            return ""
        hardware = "" if self.hardware is None else f" (HFU {self.hardware / step_median:.1%})"
        return f"\nMFU {self.model / step_median:.1%} at the median step{hardware}."


def per_step(trainer: debug.CompiledTrainer, compute_dtype: DTypeLike) -> Utilisation | None:
    """The :class:`Utilisation` of one step per second at ``compute_dtype``'s peak (``None``: no peak known)."""
    devices = jax.devices()
    peak = throughput.peak_flops(devices[0].device_kind, np.dtype(compute_dtype).name)
    if peak is None:
        return None
    model, hardware = (_counted(count, trainer) for count in (debug.model_step_flops, debug.step_flops))
    total = peak * len(devices)
    return Utilisation(None if model is None else model / total, None if hardware is None else hardware / total)


def _counted(count: Callable[[debug.CompiledTrainer], float | None], trainer: debug.CompiledTrainer) -> float | None:
    try:
        return count(trainer)
    except Exception:  # noqa: BLE001 - a strategy whose step cannot be lowered or traced: that count not shown
        logger.info("progress: %s is unknown.", count.__name__, exc_info=True)
        return None
