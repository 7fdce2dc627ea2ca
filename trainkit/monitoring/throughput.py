"""Throughput: examples (and tokens) per second, achieved FLOP/s from the compiled step's cost
analysis, and, where the device's peak is known, model FLOP utilisation (MFU, from the model's
own flops) beside the hardware's (HFU, from the compiler's count).

>>> meter = Meter(examples_per_step=32, tokens_per_example=128, flops_per_step=2e12, peak_flops=None)
>>> meter.rates(steps=10, seconds=2.0)
{'examples_per_second': 160.0, 'tokens_per_second': 20480.0, 'tflops_per_second': 10.0}
>>> Meter(32, flops_per_step=2e12, model_flops_per_step=1.5e12, peak_flops=20e12).rates(10, 2.0)["mfu"]
0.375
>>> peak_flops("NVIDIA H100 80GB HBM3", "bf16")
989000000000000.0
"""

from __future__ import annotations

import dataclasses

#: Dense peak FLOP/s per device (no sparsity), from the vendors' data sheets: (bf16/fp16, fp32).
#: GPUs' fp32 is their TF32 tensor-core rate where matmuls use it by default in XLA (A100 and
#: later); a name matches when its key is a substring of ``device.device_kind``. CPUs: none.
PEAK_FLOPS: dict[str, tuple[float, float]] = {
    "H200": (989e12, 494.5e12),
    "H100": (989e12, 494.5e12),  # SXM; the PCIe card is 756 / 378
    "GH200": (989e12, 494.5e12),
    "B200": (2250e12, 1100e12),
    "A100": (312e12, 156e12),
    "A10G": (70e12, 35e12),
    "L40S": (362e12, 183e12),
    "L4": (121e12, 60e12),
    "V100": (125e12, 15.7e12),
    "T4": (65e12, 8.1e12),
    "RTX 4090": (165e12, 82.6e12),
    "RTX 3090": (71e12, 35.6e12),
    "TPU v6": (918e12, 918e12 / 2),
    "TPU v5p": (459e12, 459e12 / 2),
    "TPU v5 lite": (197e12, 197e12 / 2),
    "TPU v5e": (197e12, 197e12 / 2),
    "TPU v4": (275e12, 275e12 / 2),
    "TPU v3": (123e12, 123e12 / 2),
}


def peak_flops(device_kind: str, precision: str = "bf16") -> float | None:
    """The device's dense peak FLOP/s for ``precision`` (``"bf16"``/``"fp16"`` or ``"fp32"``),
    or ``None`` when it is not in :data:`PEAK_FLOPS` (CPUs, unknown cards)."""
    for name in sorted(PEAK_FLOPS, key=len, reverse=True):  # "H200" before "H100", "L40S" before "L4"
        if name.lower() in device_kind.lower():
            half, single = PEAK_FLOPS[name]
            return half if precision in ("bf16", "fp16", "bfloat16", "float16") else single
    return None


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
