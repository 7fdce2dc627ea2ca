"""Attention, in one package: ``tk.attention`` (:mod:`.dispatch`: the choice and the run in one
function), the kernels it chooses from (:mod:`.kernels`), its split over a context axis
(:mod:`.context_axis`) with the causal work balanced (:mod:`.causal_balance`), and the doors by
which a context step reaches the attention a model already calls (:mod:`.reach`). It imports
``core`` only; strategies hand it their context split while a step is traced.

>>> import jax.numpy as jnp
>>> attention(jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 2, 8))).shape
(1, 4, 2, 8)
"""

from trainkit.attn.context_axis import AttentionCall, ContextSplit, active_split, attention_calls, context_split
from trainkit.attn.dispatch import attention

__all__ = ["AttentionCall", "ContextSplit", "active_split", "attention", "attention_calls", "context_split"]
