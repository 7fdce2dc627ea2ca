"""XLA's cost analysis of a lowered or compiled step, read one way whatever the JAX version.

>>> import jax, jax.numpy as jnp
>>> lowered = jax.jit(lambda a, b: a @ b).lower(jnp.ones((4, 8)), jnp.ones((8, 2)))
>>> flops(lowered)
128.0
"""

from __future__ import annotations

import jax

from trainkit.internals.runtime import hlo_cost


def cost_of(stage: jax.stages.Lowered | jax.stages.Compiled) -> dict[str, float]:
    """``stage.cost_analysis()`` (a ``jax.stages.Lowered`` or ``Compiled``) as one dict (older
    JAX returned one per computation; a backend without an analysis gives ``{}``)."""
    try:
        cost = stage.cost_analysis()
    except Exception:  # noqa: BLE001 - a compile-only GPU executable: "GetCostAnalysis is not supported"
        cost = None
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per computation
        cost = cost[0] if cost else None
    return dict(cost or hlo_cost(stage))


def flops(stage: jax.stages.Lowered | jax.stages.Compiled) -> float | None:
    """The floating-point operations ``stage`` reports, else the CPU client's count of its HLO (a
    backend's analysis without flops; ``None`` when neither counts any)."""
    value = float(cost_of(stage).get("flops", 0.0))
    if value <= 0:
        value = float(hlo_cost(stage).get("flops", 0.0))
    return value if value > 0 else None
