"""Losses a linen module adds itself, the Flax counterpart of Keras's ``add_loss``: values it
``sow``s into the ``"losses"`` collection (a weight penalty, a mixture-of-experts balancing loss).
The model adapter makes that collection writable in every call and hands it back beside the
model state; the step takes it out (:func:`split_sown`), adds each value to the loss and logs it
under its name (the same name sown by several modules: their sum).

>>> import jax.numpy as jnp
>>> model_state = {"batch_stats": {}, LOSSES: {"Block_0": {"balance": (jnp.float32(0.5),)},
...                                           "Block_1": {"balance": (jnp.float32(0.25),)}}}
>>> kept, sown = split_sown(model_state)
>>> list(kept), {name: float(value) for name, value in sown.items()}
(['batch_stats'], {'balance': 0.75})
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trainkit.core.tree import PyTree

#: the collection a module sows its own losses into: ``self.sow("losses", "balance", value)``
LOSSES = "losses"


def split_sown(model_state: PyTree) -> tuple[PyTree, dict[str, jax.Array]]:
    """``(model_state without the sown losses, {name: the sum of the values sown under it})``;
    each value a scalar or one value per row."""
    if not isinstance(model_state, dict) or LOSSES not in model_state:
        return model_state, {}
    kept = {key: value for key, value in model_state.items() if key != LOSSES}
    sown: dict[str, jax.Array] = {}

    def visit(tree: PyTree) -> None:
        for name, value in tree.items():
            if isinstance(value, dict):
                visit(value)
                continue
            values = value if isinstance(value, tuple) else (value,)
            for one in values:
                one = jnp.asarray(one, jnp.float32)
                sown[name] = one if name not in sown else sown[name] + one

    visit(model_state[LOSSES])
    return kept, sown
