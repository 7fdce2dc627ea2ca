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

from trainkit.core import chips
from trainkit.core.chips import Chip

if TYPE_CHECKING:  # importing jax loads its plugins, which log: `python -m trainkit plan` parses a target first
    import jax

#: the chips a target may name, from the one table (:mod:`trainkit.core.chips`)
CHIPS = chips.FAMILIES

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
        roofline = self.chip.roofline
        assert roofline is not None, f"{self.chip.name} is a target: the table gives its memory"
        return int(roofline.memory * roofline.usable)

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


#: an H100 host's GPUs (a TPU slice's largest size and sides are in the chips' table)
GPUS_PER_HOST = 8


def _slice(spec: str, family: str, dims: str, slices: int = 1) -> Target:
    """A TPU slice (``slices`` of them), refused (with the shapes that exist) when a side is 0 or
    it has more chips than any slice of its family."""
    sides, chip = [int(d) for d in dims.split("x")], CHIPS[family]
    count, most, shape = math.prod(sides), chip.most_chips, chip.sides
    if not 0 < count <= most:
        raise ValueError(
            f"Target {spec!r} has {count} chips: a TPU {family} slice has 1 to {most}, every side at "
            f'least 1 (e.g. "tpu {family}:{"2x2" if len(sides) == 2 else "2x2x1"}"). Spell it {SPELLINGS}.'
        )
    if len(sides) != shape or not all(_side_exists(side, len(sides)) for side in sides):
        example = "4x4" if shape == 2 else "2x2x2"
        raise ValueError(
            f"Target {spec!r} is not a {family} slice: its slices have {shape} sides, each a power of two"
            f'{" (or a multiple of 4)" if shape == 3 else ""} (e.g. "tpu {family}:{example}"). '
            f"Spell it {SPELLINGS}."
        )
    if slices < 1:
        raise ValueError(f"Target {spec!r} has {slices} slices: at least 1. Spell it {SPELLINGS}.")
    hosts = max(1, count // 4) * slices
    return Target(spec, "tpu", chip, f"{family}:{dims}", count * slices, hosts, slices)


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
    return chips.chip_of_kind(str(device.device_kind))
