"""XLA's cost analysis of a lowered or compiled step, read one way whatever the JAX version, and
the model's own flops counted from its traced matrix multiplies (:func:`model_flops`).

>>> import jax, jax.numpy as jnp
>>> lowered = jax.jit(lambda a, b: a @ b).lower(jnp.ones((4, 8)), jnp.ones((8, 2)))
>>> flops(lowered)
128.0
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from trainkit.internals import jaxpr
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


#: the ``jax.named_scope`` ``tk.attention`` traces causal attention in: its score matmuls count half
CAUSAL_ATTENTION_SCOPE = "trainkit_causal_attention"


def model_flops(forward: Callable[..., object], *args: object) -> float:
    """A training step's flops as the model's own matrix multiplies count them, the way MaxText
    and PaLM's MFU do: three times the forward pass's (the backward pass computes two products per
    forward one: ``6N`` per token for ``N`` weights, attention's included), causal attention's
    halved, whatever the compiler does (remat's recomputation, fusions: those are in the
    compiler's, hardware, count). ``forward`` is traced on ``args`` (arrays or their shapes).

    >>> import jax.numpy as jnp
    >>> model_flops(lambda w, x: x @ w, jnp.ones((8, 2)), jnp.ones((4, 8)))  # 3 x 2 x 4 x 8 x 2
    384.0
    """
    closed = jax.make_jaxpr(forward)(*args)
    return 3.0 * jaxpr.matmul_flops(closed.jaxpr, CAUSAL_ATTENTION_SCOPE)
