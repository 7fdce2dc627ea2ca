"""How long a lowered program will take to compile, told before it compiles: a compile for a
large slice is minutes on a small machine, so a plan's progress line says what to expect.

The estimate is a fixed cost plus the program's size (its StableHLO operations) times a rate,
per platform, measured on a 2-core machine (``benchmarks/compile_rate.py``: the LM example's
train step, 1 to 4 blocks, on ``tpu v5e:2x2``, ``v5e:4x4`` and ``h100 x8``); once the plan has
compiled a candidate, the estimates are scaled by how long its compiles took against theirs.
It is a guide: compile time grows with the tensors' sizes too (a 38.5M-parameter LM's FSDP
step for ``v5e:4x4`` took 575 s here), and that shows in the scale from the first compile on.

>>> rates = CompileRates()
>>> round(rates.estimate(2_000, "tpu"), 1)
15.0
>>> rates.observe(2_000, "tpu", seconds=30.0); round(rates.estimate(4_000, "tpu"), 1)
50.0
"""

from __future__ import annotations

import re

import jax

#: per target platform ("tpu", "cuda"): (seconds of any compile, seconds per StableHLO operation),
#: before any compile of the plan was seen (``benchmarks/compile_rate.py`` on a 2-core machine)
DEFAULT_RATES = {"tpu": (5.0, 5e-3), "cuda": (4.0, 1e-3)}

_OPERATION = re.compile(r"^\s*(?:%[\w#:, %]+=\s*)?\"?[a-z_]+\.[a-z_]", re.M)


def program_ops(lowered: jax.stages.Lowered) -> int:
    """The operations of a ``jax.stages.Lowered`` program (its StableHLO, one per line that
    starts an operation); 0 where it has no text form.

    >>> import jax, jax.numpy as jnp
    >>> program_ops(jax.jit(lambda x: jnp.sin(x) * 2).lower(1.0)) >= 2
    True
    """
    try:
        text = lowered.as_text()
    except Exception:  # noqa: BLE001 - a lowered form without text: no estimate, nothing else lost
        return 0
    return len(_OPERATION.findall(text))


class CompileRates:
    """Compile-time estimates by platform: the defaults, scaled by this plan's compiles so far."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[float, float]] = {}  # platform -> (seconds estimated, seconds taken)

    @staticmethod
    def _default(ops: int, platform: str) -> float:
        fixed, per_op = DEFAULT_RATES.get(platform, DEFAULT_RATES["tpu"])
        return fixed + per_op * ops

    def observe(self, ops: int, platform: str, seconds: float) -> None:
        """A compile of ``ops`` operations for ``platform`` took ``seconds``."""
        if ops > 0:
            estimated, taken = self._seen.get(platform, (0.0, 0.0))
            self._seen[platform] = (estimated + self._default(ops, platform), taken + seconds)

    def estimate(self, ops: int, platform: str) -> float:
        """The seconds a compile of ``ops`` operations for ``platform`` is expected to take."""
        estimated, taken = self._seen.get(platform, (1.0, 1.0))
        return self._default(ops, platform) * taken / estimated


def duration(seconds: float) -> str:
    """``seconds`` as a person reads an estimate.

    >>> duration(0.4), duration(42), duration(575)
    ('1 s', '42 s', '10 min')
    """
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    return f"{round(seconds / 60)} min"
