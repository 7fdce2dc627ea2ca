"""The training state: one immutable pytree with no functions inside.

>>> import jax.numpy as jnp
>>> state = TrainState.create(params={"w": jnp.zeros(2)}, opt_state=(), model_state={}, seed=0)
>>> int(state.step), sorted(state.params)
(0, ['w'])
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Self

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from trainkit.core import tree
from trainkit.core.checks import SettingError
from trainkit.core.precision import NoLossScale
from trainkit.core.tree import PyTree

Batch = dict[str, PyTree]


@flax.struct.dataclass
class TrainState:
    """Everything a training step reads and writes.

    Attributes:
        step: number of optimizer updates applied so far (int32 scalar).
        params: the trainable parameters.
        opt_state: the optax optimizer state.
        model_state: non-parameter Flax collections such as ``batch_stats``.
        rng: a raw ``uint32[2]`` PRNG key; each step folds in its step number.
        loss_scale: the loss-scale state of the precision policy
            (:class:`trainkit.core.precision.NoLossScale` unless fp16).
        spikes: the running average of ``Trainer(skip_spikes=...)``
            (:class:`trainkit.core.spikes.SpikeState`), else ``None`` (no leaves; not saved).
    """

    if TYPE_CHECKING:  # flax.struct.dataclass adds it

        def replace(self, **changes: object) -> Self: ...

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    model_state: PyTree
    rng: jax.Array
    loss_scale: PyTree = dataclasses.field(default_factory=NoLossScale)
    spikes: PyTree = None

    @classmethod
    def create(cls, *, params: PyTree, opt_state: PyTree, model_state: PyTree, seed: int | jax.Array) -> TrainState:
        """A fresh state at step 0 whose rng comes from ``seed``."""
        rng = jax.random.PRNGKey(seed) if isinstance(seed, int) else seed
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state, model_state=model_state, rng=rng)


def seed_key(seed: int) -> np.ndarray:
    """``jax.random.key_data(jax.random.PRNGKey(seed))``, computed on the host (nothing
    compiled) for JAX's default threefry keys: ``[high word, low word]`` of the seed, the high
    word 0 unless 64-bit integers are on (JAX keeps only a Python int's low 32 bits then).

    >>> seed_key(-1).tolist(), seed_key(2**32 + 5).tolist()
    ([0, 4294967295], [0, 5])
    """
    if jax.config.values["jax_default_prng_impl"] != "threefry2x32":
        return np.asarray(jax.random.key_data(jax.random.PRNGKey(seed)))
    wrapped = int(seed) % 2**64
    high = wrapped >> 32 if jax.config.values["jax_enable_x64"] else 0
    return np.array([high, wrapped & 0xFFFFFFFF], np.uint32)


def abstract(tree: PyTree) -> PyTree:
    """``jax.ShapeDtypeStruct`` of every array, with its sharding: what lowering needs, nothing
    allocated."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_sharding_of(a)), tree)


def _sharding_of(leaf: object) -> jax.sharding.Sharding | None:
    return leaf.sharding if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) else None


def check_tree_matches(
    what: str,
    expected: PyTree,
    received: PyTree,
    fix: str = "Pass variables created by the same model (e.g. from trainer.get_weights()).",
) -> None:
    """Raises a :class:`~trainkit.core.checks.SettingError` (a ``ValueError``) naming every path
    whose presence or shape differs.

    >>> check_tree_matches("params=", {"w": jnp.zeros(2)}, {"w": jnp.zeros(3)})
    Traceback (most recent call last):
    trainkit.core.checks.SettingError: params= does not match the model's variables: ['w']: ...
    """
    names = ("model's variables", "variables given")
    problems = tree.difference("", tree.signature(expected), tree.signature(received), names=names, dtypes=False)
    if problems:
        raise SettingError(
            f"{what} does not match the model's variables: "
            + "; ".join(problems[:10])
            + (f" (and {len(problems) - 10} more)" if len(problems) > 10 else "")
            + f". {fix}"
        )
