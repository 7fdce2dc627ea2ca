"""The training state: one immutable pytree with no functions inside.

>>> import jax.numpy as jnp
>>> state = TrainState.create(params={"w": jnp.zeros(2)}, opt_state=(), model_state={}, seed=0)
>>> int(state.step), sorted(state.params)
(0, ['w'])
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

PyTree = Any
Batch = dict[str, Any]


@flax.struct.dataclass
class TrainState:
    """Everything a training step reads and writes.

    Attributes:
        step: number of optimizer updates applied so far (int32 scalar).
        params: the trainable parameters.
        opt_state: the optax optimizer state.
        model_state: non-parameter Flax collections such as ``batch_stats``.
        rng: a raw ``uint32[2]`` PRNG key; each step folds in its step number.
        loss_scale: the loss-scale state of the precision policy, or ``None``.
    """

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    model_state: PyTree
    rng: jax.Array
    loss_scale: PyTree = None

    @classmethod
    def create(
        cls, *, params: PyTree, opt_state: PyTree, model_state: PyTree, seed: int | jax.Array
    ) -> "TrainState":
        """A fresh state at step 0 whose rng comes from ``seed``."""
        rng = jax.random.PRNGKey(seed) if isinstance(seed, int) else seed
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=opt_state,
            model_state=model_state,
            rng=rng,
        )
