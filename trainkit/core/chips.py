"""Every accelerator's public figures in one table, read by MFU (``monitoring/``), the plan's
step-time estimate and memory check, and the compile-only targets a plan is made for
(``program/``): the dense peak flop/s at bf16 and fp32, and where a plan uses them the memory,
its bandwidth, the interconnect's, and a TPU slice's shape. Plain data: nothing here starts JAX.

>>> peak_flops("NVIDIA H100 80GB HBM3", "bf16"), peak_flops("cpu")
(989000000000000.0, None)
>>> chip_of_kind("TPU v5 lite").name, chip_of_kind("NVIDIA GH200 480GB").name  # the longest kind that matches
('TPU v5e', 'NVIDIA GH200')
>>> sorted(FAMILIES)
['h100', 'v4', 'v5e', 'v5p', 'v6e']
"""

from __future__ import annotations

import dataclasses

GIB = 2**30
#: the precisions that run at a chip's bf16 peak (the rest at its fp32 one)
HALF_PRECISIONS = ("bf16", "fp16", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Roofline:
    """What a plan needs of a chip beyond its peak flop/s.

    Attributes:
        memory: device memory, bytes.
        usable: the share of it a program may use (GPU: JAX preallocates 75% by default).
        bandwidth: memory bytes/s.
        link: interconnect bytes/s per chip (TPU ICI, NVLink), one direction.
        reached: the share of the compute-or-memory roofline a real train step was measured to reach
            on the chip (1.0: not measured), where the plan has no ``cycle_rate`` to use. TPU v5e: 0.58,
            a 12 x 1,024 LM (151M parameters, length 512, bf16, batch 128, remat of its blocks) whose
            plan estimated 412.7 ms/step at the peak figures and ran at 710.9 ms (issue #68); 1.60-1.83x
            off on the same model without remat and on an 8 x 768 LM (issue #80): the compiler's bytes
            accessed are no memory time on a TPU.
        cycle_rate: the TPU compiler's estimated cycles (``planning.compiler_cycles``) a real train step
            retires per second on the chip (0: not measured). TPU v5e: 2.383e9, the same 12 x 1,024 LM
            at batch 128 with remat (1,706,942,594 cycles in 716.3 ms, 2026-12-07); the same chip's
            other steps that day: the 12 x 1,024 LM at batch 32 and 64 without remat, 0.82 and 0.93 of
            their real steps, the 8 x 768 LM at batch 32, 0.82. It counts no Pallas kernel (a custom
            call): attention through one is left out of the estimate.
        cycle_spread: the lowest and highest estimate over real step among the steps ``cycle_rate`` was
            checked on (what a plan says of its trust).
    """

    memory: int
    usable: float
    bandwidth: float
    link: float
    reached: float = 1.0
    cycle_rate: float = 0.0
    cycle_spread: tuple[float, float] = (1.0, 1.0)


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator: ``name`` as the docs name it; ``kinds``, what its devices report as
    ``device_kind`` (matched as a part of it, case aside); ``flops`` / ``flops_fp32``, its dense
    peak (no sparsity; fp32 as TF32 where XLA uses it for matmuls, A100 and later); ``roofline``
    where a plan estimates a step on it; ``family``, a plan target's spelling (``"tpu v5e:4x4"``,
    ``"h100 x8"``) where its compile-only devices exist; for a TPU, its largest slice and how many
    sides a slice has (a 2-D mesh or a 3-D torus)."""

    name: str
    kinds: tuple[str, ...]
    flops: float
    flops_fp32: float
    roofline: Roofline | None = None
    family: str | None = None
    most_chips: int = 0
    sides: int = 0


#: Vendors' data sheets and Google Cloud's TPU pages, approximate.
CHIPS: tuple[Chip, ...] = (
    Chip("NVIDIA H200", ("H200",), 989e12, 494.5e12),
    Chip("NVIDIA H100 SXM", ("H100",), 989e12, 494.5e12,  # the PCIe card is 756 / 378
         Roofline(80 * 10**9, 0.75, 3.35e12, 450e9), family="h100"),
    Chip("NVIDIA GH200", ("GH200",), 989e12, 494.5e12),
    Chip("NVIDIA B200", ("B200",), 2250e12, 1100e12),
    Chip("NVIDIA A100", ("A100",), 312e12, 156e12),
    Chip("NVIDIA A10G", ("A10G",), 70e12, 35e12),
    Chip("NVIDIA L40S", ("L40S",), 362e12, 183e12),
    Chip("NVIDIA L4", ("L4",), 121e12, 60e12),
    Chip("NVIDIA V100", ("V100",), 125e12, 15.7e12),
    Chip("NVIDIA T4", ("T4",), 65e12, 8.1e12),
    Chip("NVIDIA RTX 4090", ("RTX 4090",), 165e12, 82.6e12),
    Chip("NVIDIA RTX 3090", ("RTX 3090",), 71e12, 35.6e12),
    Chip("TPU v6e", ("TPU v6 lite", "TPU v6e", "TPU v6"), 918e12, 459e12,
         Roofline(32 * GIB, 1.0, 1.64e12, 448e9), family="v6e", most_chips=256, sides=2),
    Chip("TPU v5p", ("TPU v5p", "TPU v5"), 459e12, 229.5e12,
         Roofline(95 * GIB, 1.0, 2.765e12, 600e9), family="v5p", most_chips=8960, sides=3),
    Chip("TPU v5e", ("TPU v5 lite", "TPU v5e"), 197e12, 98.5e12,
         Roofline(16 * GIB, 1.0, 819e9, 200e9, reached=412.7 / 710.9, cycle_rate=1_706_942_594 / 0.7163,
                  cycle_spread=(0.82, 1.0)),
         family="v5e", most_chips=256, sides=2),
    Chip("TPU v4", ("TPU v4",), 275e12, 137.5e12,
         Roofline(32 * GIB, 1.0, 1.2e12, 300e9), family="v4", most_chips=4096, sides=3),
    Chip("TPU v3", ("TPU v3",), 123e12, 61.5e12),
)  # fmt: skip

#: the chips a plan can target by name (``"tpu v5e:4x4"``: ``"v5e"``)
FAMILIES: dict[str, Chip] = {chip.family: chip for chip in CHIPS if chip.family is not None}

#: Rough per-device (flop/s, memory bytes/s, collective bytes/s) of a device no row names, by
#: platform: a plan's estimate only (``measure=True`` replaces it by real timings).
UNKNOWN_RATES: dict[str, tuple[float, float, float]] = {
    "cpu": (5e10, 1e10, 5e9),
    "gpu": (5e13, 2e12, 1e11),
    "tpu": (1e14, 1e12, 1e11),
}


def chip_of_kind(device_kind: str) -> Chip | None:
    """The chip of :data:`CHIPS` whose kind is the longest part of ``device_kind`` ("GH200" before
    "H200", "L40S" before "L4", "TPU v5 lite" before "TPU v5"); ``None`` for a CPU or an unknown card."""
    text = device_kind.lower()
    matches = [(len(kind), chip) for chip in CHIPS for kind in chip.kinds if kind.lower() in text]
    return max(matches, key=lambda match: match[0])[1] if matches else None


def peak_flops(device_kind: str, precision: str = "bf16") -> float | None:
    """The device's dense peak flop/s at ``precision`` (``"bf16"``/``"fp16"`` or ``"fp32"``; NumPy's
    names too), or ``None`` when no row names its kind (CPUs, unknown cards)."""
    chip = chip_of_kind(device_kind)
    if chip is None:
        return None
    return chip.flops if precision in HALF_PRECISIONS else chip.flops_fp32
