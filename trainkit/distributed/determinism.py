"""``Trainer(deterministic=True)``: the XLA settings under which a GPU run repeats bit for bit.

``--xla_gpu_deterministic_ops=true`` makes XLA:GPU use deterministic reductions and scatters
(no atomics) and turns off the autotuning whose kernel choice varies from run to run; XLA reads
it when the GPU backend starts, so it is added to ``XLA_FLAGS`` before anything touches JAX's
devices, or, when the backend already started without it, refused with the fix. XLA:CPU already
repeats bit for bit (the same program on the same inputs), as do trainkit's data order and dropout
keys (from ``seed``); the cost is GPU-only: deterministic scatters and reductions and untuned
kernels are slower (docs/tuning.md).

>>> missing_flags("--xla_force_host_platform_device_count=8")
['--xla_gpu_deterministic_ops=true']
>>> problem(["--xla_gpu_deterministic_ops=true"], started=True, platforms={"cpu"}) is None
True
"""

from __future__ import annotations

import os

import jax

from trainkit.internals.runtime import backends_started

#: The flags ``deterministic=True`` needs in ``XLA_FLAGS`` before the backend starts.
DETERMINISTIC_FLAGS = ("--xla_gpu_deterministic_ops=true",)


def missing_flags(xla_flags: str) -> list[str]:
    """The deterministic flags that ``xla_flags`` (an ``XLA_FLAGS`` value) lacks."""
    given = xla_flags.split()
    return [flag for flag in DETERMINISTIC_FLAGS if flag not in given]


def problem(missing: list[str], *, started: bool, platforms: set[str]) -> str | None:
    """Why the flags cannot take effect (a GPU backend started without them), else ``None``."""
    if not missing or not started or "gpu" not in platforms:
        return None
    return (
        f"deterministic=True needs XLA_FLAGS to hold {' '.join(missing)} before JAX starts its GPU backend, and "
        "it started already (something called jax.devices() or ran an operation before Trainer(...)). Create "
        "the Trainer first, call trainkit.distributed.enable_determinism() at the top of the script, or run "
        f'with XLA_FLAGS="$XLA_FLAGS {" ".join(missing)}".'
    )


def enable_determinism() -> None:
    """Adds :data:`DETERMINISTIC_FLAGS` to ``XLA_FLAGS`` (a no-op when they are there); raises
    when a GPU backend already started without them."""
    flags = os.environ.get("XLA_FLAGS", "")
    missing = missing_flags(flags)
    if not missing:
        return
    started = backends_started()
    reason = problem(missing, started=started, platforms={d.platform for d in jax.devices()} if started else set())
    if reason is not None:
        raise RuntimeError(reason)
    if not started:
        os.environ["XLA_FLAGS"] = " ".join([flags, *missing]).strip()
