"""Throughput: examples (and tokens) per second, achieved FLOP/s from the compiled step's cost
analysis, and, where the device's peak is known, model FLOP utilisation (MFU, from the model's
own flops) beside the hardware's (HFU, from the compiler's count).

>>> meter = Meter(examples_per_step=32, tokens_per_example=128, flops_per_step=2e12, peak_flops=None)
>>> meter.rates(steps=10, seconds=2.0)
{'examples_per_second': 160.0, 'tokens_per_second': 20480.0, 'tflops_per_second': 10.0}
>>> Meter(32, flops_per_step=2e12, model_flops_per_step=1.5e12, peak_flops=20e12).rates(10, 2.0)["mfu"]
0.375
>>> peak_flops("NVIDIA H100 80GB HBM3", "bf16")  # trainkit.core.chips' table, which plans read too
989000000000000.0
"""

from __future__ import annotations

import dataclasses

from trainkit.core.chips import peak_flops

__all__ = ["Meter", "peak_flops"]


@dataclasses.dataclass
class Meter:
    """Turns steps and seconds into rates: ``examples_per_step`` (the global batch),
    ``tokens_per_example`` (a sequence model's length; ``None`` otherwise),
    ``flops_per_step`` (the compiled step's, all devices together: ``tflops_per_second`` and
    ``hfu``), ``model_flops_per_step`` (the model's own: ``mfu``) and ``peak_flops`` (all
    devices together; ``None`` when unknown: neither utilisation)."""

    examples_per_step: int
    tokens_per_example: int | None = None
    flops_per_step: float | None = None
    peak_flops: float | None = None
    model_flops_per_step: float | None = None

    def rates(self, steps: int, seconds: float) -> dict[str, float]:
        if steps <= 0 or seconds <= 0:
            return {}
        per_second = steps / seconds
        rates = {"examples_per_second": per_second * self.examples_per_step}
        if self.tokens_per_example:
            rates["tokens_per_second"] = rates["examples_per_second"] * self.tokens_per_example
        if self.flops_per_step:
            achieved = per_second * self.flops_per_step
            rates["tflops_per_second"] = achieved / 1e12
            if self.peak_flops:
                rates["hfu"] = achieved / self.peak_flops
        if self.model_flops_per_step and self.peak_flops:
            rates["mfu"] = per_second * self.model_flops_per_step / self.peak_flops
        return rates
