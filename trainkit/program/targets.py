"""Devices that are not here: a TPU slice or NVIDIA GPUs named as a plan's ``target``, whose
compile-only devices the real step is compiled for on this machine (libtpu's and the CUDA
plugin's compilers, no accelerator needed). See docs/targets.md.

>>> target = parse("tpu v5e:4x4")
>>> target.chip.name, target.device_count, target.memory_limit / 2**30
('TPU v5e', 16, 16.0)
>>> parse("h100 2x8").topology, parse("h100 x8").device_count
('2x1x8', 8)
>>> two = parse("tpu v5p:2x2x1 x2")  # two slices of 4 chips, joined by the data-center network
>>> two.topology, two.slices, two.device_count
('v5p:2x2x1', 2, 8)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # importing jax loads its plugins, which log: `python -m trainkit plan` parses a target first
    import jax

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator's public figures: what the estimate and the fit check use.

    Attributes:
        name: as the docs name it.
        memory: device memory, bytes.
        usable: the share of it a program may use (GPU: JAX preallocates 75% by default).
        flops: peak dense bf16 flop/s.
        bandwidth: memory bytes/s.
        link: interconnect bytes/s per chip (TPU ICI, NVLink), one direction.
        kinds: ``device_kind`` strings of its (compile-only) devices.
        reached: the share of the compute-or-memory roofline a real train step was measured to reach
            on the chip (1.0: not measured). TPU v5e: 0.58, a 12 x 1,024 LM (151M parameters, length
            512, bf16, batch 128, remat of its blocks) whose plan estimated 412.7 ms/step at the peak
            figures and ran at 710.9 ms (issue #68's run on one chip).
    """

    name: str
    memory: int
    usable: float
    flops: float
    bandwidth: float
    link: float
    kinds: tuple[str, ...]
    reached: float = 1.0


#: Public figures (Google Cloud's TPU pages, NVIDIA's H100 SXM datasheet), approximate.
CHIPS = {
    "v4": Chip("TPU v4", 32 * GIB, 1.0, 275e12, 1.2e12, 300e9, ("TPU v4",)),
    "v5e": Chip("TPU v5e", 16 * GIB, 1.0, 197e12, 819e9, 200e9, ("TPU v5 lite", "TPU v5e"), reached=412.7 / 710.9),
    "v5p": Chip("TPU v5p", 95 * GIB, 1.0, 459e12, 2.765e12, 600e9, ("TPU v5", "TPU v5p")),
    "v6e": Chip("TPU v6e", 32 * GIB, 1.0, 918e12, 1.64e12, 448e9, ("TPU v6 lite", "TPU v6e")),
    "h100": Chip("NVIDIA H100 SXM", 80 * 10**9, 0.75, 989e12, 3.35e12, 450e9, ("NVIDIA H100 80GB HBM3",)),
}

#: The compile-only CUDA client needs the GPU described (XLA's ``GpuTargetConfigProto``): an H100 SXM.
H100_TARGET_CONFIG = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 9 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

SPELLINGS = (
    '"tpu <family>:<AxB[xC]>" (e.g. "tpu v5e:4x4", "tpu v5p:2x2x2"), "tpu <family>:<AxB[xC]> x<slices>" '
    '(slices joined by the data-center network, e.g. "tpu v5p:2x2x1 x2") or "h100 x<N>" / "h100 <hosts>x<N>"'
)


@dataclasses.dataclass(frozen=True)
class Target:
    """A parsed target: ``platform`` (``"tpu"`` or ``"cuda"``), the chip, and the topology as
    the compiler names it (``"v5e:4x4"``, ``"2x1x8"``); ``slices`` TPU slices of that topology,
    joined by the data-center network (DCN), their devices slice after slice."""

    spec: str
    platform: str
    chip: Chip
    topology: str
    device_count: int
    hosts: int
    slices: int = 1

    @property
    def memory_limit(self) -> int:
        """Bytes a step may use on one device."""
        return int(self.chip.memory * self.chip.usable)

    def devices(self) -> list[jax.Device]:
        """The target's compile-only devices (nothing can run on them; nothing is allocated)."""
        from jax.experimental.topologies import get_topology_desc

        if self.platform == "tpu":
            _require("libtpu", "tpu-plan", "libtpu, the TPU compiler")
            # no TPU host here: libtpu would look for one and print its warnings (before it first loads)
            os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
            os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
            # compiling holds no TPU: several processes may load libtpu (else the first one's lockfile refuses the rest)
            os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
            options: dict[str, str | int] = {"chip_config_name": "megacore"} if self.topology.startswith("v4:") else {}
            if self.slices > 1:
                options["num_slices"] = self.slices
            return list(get_topology_desc(topology_name=self.topology, platform="tpu", **options).devices)
        _require("jax_plugins.xla_cuda12", "gpu-plan", "the CUDA plugin's compiler")
        if os.environ.get("JAX_PLATFORMS", "") != "cpu":
            raise RuntimeError(
                f"Planning for {self.spec!r} needs JAX_PLATFORMS=cpu set before JAX starts (the CUDA plugin checks "
                "for a GPU otherwise and does not register); run `JAX_PLATFORMS=cpu python ...` or "
                "`python -m trainkit plan`, which sets it."
            )
        return list(
            get_topology_desc(platform="cuda", target_config=H100_TARGET_CONFIG, topology=self.topology).devices
        )


def _require(module: str, extra: str, what: str) -> None:
    if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
        raise ImportError(f"A plan for this target needs {what}: pip install 'trainkit[{extra}]' (pinned to your jax).")


#: the most chips one slice of each TPU family has (Google Cloud's TPU pages); an H100 host's GPUs
MOST_CHIPS = {"v4": 4096, "v5e": 256, "v5p": 8960, "v6e": 256}
#: the sides of a family's slices: a 2-D mesh (v5e, v6e) or a 3-D torus (v4, v5p)
SIDES = {"v4": 3, "v5e": 2, "v5p": 3, "v6e": 2}
GPUS_PER_HOST = 8


def _slice(spec: str, family: str, dims: str, slices: int = 1) -> Target:
    """A TPU slice (``slices`` of them), refused (with the shapes that exist) when a side is 0 or
    it has more chips than any slice of its family."""
    sides = [int(d) for d in dims.split("x")]
    count = math.prod(sides)
    if not 0 < count <= MOST_CHIPS[family]:
        raise ValueError(
            f"Target {spec!r} has {count} chips: a TPU {family} slice has 1 to {MOST_CHIPS[family]}, every side at "
            f'least 1 (e.g. "tpu {family}:{"2x2" if len(sides) == 2 else "2x2x1"}"). Spell it {SPELLINGS}.'
        )
    if len(sides) != SIDES[family] or not all(_side_exists(side, len(sides)) for side in sides):
        example = "4x4" if SIDES[family] == 2 else "2x2x2"
        raise ValueError(
            f"Target {spec!r} is not a {family} slice: its slices have {SIDES[family]} sides, each a power of two"
            f'{" (or a multiple of 4)" if SIDES[family] == 3 else ""} (e.g. "tpu {family}:{example}"). '
            f"Spell it {SPELLINGS}."
        )
    if slices < 1:
        raise ValueError(f"Target {spec!r} has {slices} slices: at least 1. Spell it {SPELLINGS}.")
    hosts = max(1, count // 4) * slices
    return Target(spec, "tpu", CHIPS[family], f"{family}:{dims}", count * slices, hosts, slices)


def _side_exists(side: int, sides: int) -> bool:
    """Whether a slice side of this length exists: a power of two (a multiple of 4 on a 3-D torus too)."""
    return side & (side - 1) == 0 or (sides == 3 and side % 4 == 0)


def parse(spec: str) -> Target:
    """A target from its spelling (see ``SPELLINGS``); a clear error otherwise, before anything
    is compiled (a slice of 0 or too many chips, a host of 0 or more than 8 GPUs)."""
    text = " ".join(str(spec).lower().split())
    tpu = re.fullmatch(r"tpu (v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})(?: x(\d+))?", text)
    if tpu:
        family, dims, slices = tpu.groups()
        return _slice(spec, family, dims, int(slices or 1))
    gpu = re.fullmatch(r"h100 (?:(\d+)x|x)(\d+)", text)
    if gpu:
        hosts, per_host = int(gpu.group(1) or 1), int(gpu.group(2))
        if hosts < 1 or not 1 <= per_host <= GPUS_PER_HOST:
            raise ValueError(
                f"Target {spec!r} has {hosts} host(s) of {per_host} GPUs: an H100 host has 1 to {GPUS_PER_HOST}, and "
                f'a target at least 1 host (e.g. "h100 x8", "h100 2x8"). Spell it {SPELLINGS}.'
            )
        return Target(spec, "cuda", CHIPS["h100"], f"{hosts}x1x{per_host}", hosts * per_host, hosts)
    raise ValueError(f"Unknown target {spec!r}: spell it {SPELLINGS}. Known chips: {sorted(CHIPS)}.")


def chip_of(device: Any) -> Chip | None:
    """The chip of a (real or compile-only) device, when the table knows its kind."""
    kind = str(device.device_kind)
    return next((chip for chip in CHIPS.values() if kind in chip.kinds), None)
