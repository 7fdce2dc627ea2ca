"""XLA's cost analysis of a lowered or compiled step, read one way whatever the JAX version.

>>> import jax, jax.numpy as jnp
>>> lowered = jax.jit(lambda a, b: a @ b).lower(jnp.ones((4, 8)), jnp.ones((8, 2)))
>>> flops(lowered)
128.0
"""

from __future__ import annotations

from typing import Any


def cost_of(stage: Any) -> dict[str, float]:
    """``stage.cost_analysis()`` (a ``jax.stages.Lowered`` or ``Compiled``) as one dict (older
    JAX returned one per computation; a backend without an analysis gives ``{}``)."""
    try:
        cost = stage.cost_analysis()
    except Exception:  # noqa: BLE001 - a compile-only GPU executable: "GetCostAnalysis is not supported"
        cost = None
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per computation
        cost = cost[0] if cost else None
    return dict(cost or _hlo_cost(stage))


def _hlo_cost(stage: Any) -> dict[str, float]:
    """XLA's HLO cost analysis of a compiled executable's optimised module (or a lowered stage's
    module), run by the CPU client: the flops of a compile-only GPU step, whose executable has no
    analysis of its own, and of a step whose backend reports no flops (JAX's private
    ``hlo_module_cost_analysis``; ``{}`` where it is missing or fails)."""
    try:
        import jax
        from jax._src.lib import _jax

        if isinstance(stage, jax.stages.Lowered):
            computation = stage.compiler_ir("hlo")
            if computation is None:
                return {}
            module = computation.as_hlo_module()
        else:
            module = stage.runtime_executable().hlo_modules()[0]
        return dict(_jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module))
    except Exception:  # noqa: BLE001 - a private API, a Lowered stage, no CPU backend: no figure
        return {}


def flops(stage: Any) -> float | None:
    """The floating-point operations ``stage`` reports, else the CPU client's count of its HLO (a
    backend's analysis without flops; ``None`` when neither counts any)."""
    value = float(cost_of(stage).get("flops", 0.0))
    if value <= 0:
        value = float(_hlo_cost(stage).get("flops", 0.0))
    return value if value > 0 else None
