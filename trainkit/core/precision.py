"""The precision policy: parameter, compute and output dtypes, and the loss scale.

``"bf16"`` and ``"fp16"`` are *mixed*: float32 master parameters and optimizer state, the
forward and backward pass in the compute dtype, the loss and metrics in float32. ``"fp16"``
adds dynamic loss scaling: the loss is multiplied by a scale before differentiation, the
gradients are divided by it, a step whose gradients are not finite is skipped and halves the
scale, and the scale doubles after ``growth_interval`` finite steps in a row.

>>> import jax.numpy as jnp
>>> policy = get_precision("bf16")
>>> policy.compute_dtype, policy.param_dtype, policy.loss_scale
(dtype(bfloat16), dtype('float32'), None)
>>> scale = get_precision("fp16").init_loss_scale()
>>> float(scale.loss_scale), float(scale.adjust(jnp.array(False)).loss_scale)
(32768.0, 16384.0)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Self

import clu.metrics
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from trainkit.core.sown import LOSSES, split_sown
from trainkit.core.tree import Apply, PyTree


@flax.struct.dataclass
class NoLossScale:
    """No loss scaling (fp32 and bf16): every method is the identity, so the compiled step has
    no scaling or finiteness work at all."""

    if TYPE_CHECKING:  # flax.struct.dataclass adds it

        def replace(self, **changes: object) -> Self: ...

    def scale(self, loss: jax.Array) -> jax.Array:
        return loss

    def unscale(self, grads: PyTree) -> PyTree:
        return grads

    def guard(self, grads: PyTree, new: PyTree, old: PyTree) -> tuple[PyTree, NoLossScale]:
        """``(new, self)``: every update is applied."""
        return new, self

    def metrics(self) -> dict[str, clu.metrics.Metric]:
        return {}


@flax.struct.dataclass
class StaticLossScale:
    """A fixed scale: the loss is multiplied by ``scale`` before differentiation, the gradients
    divided by it, and a step whose gradients are not finite is skipped."""

    if TYPE_CHECKING:  # flax.struct.dataclass adds it

        def replace(self, **changes: object) -> Self: ...

    loss_scale: jax.Array

    def scale(self, loss: jax.Array) -> jax.Array:
        return loss * self.loss_scale.astype(loss.dtype)

    def unscale(self, grads: PyTree) -> PyTree:
        inverse = 1.0 / self.loss_scale
        return jax.tree.map(lambda g: (g * inverse).astype(g.dtype), grads)

    def adjust(self, finite: jax.Array) -> StaticLossScale:
        return self

    def guard(self, grads: PyTree, new: PyTree, old: PyTree) -> tuple[PyTree, StaticLossScale]:
        """``new`` where every gradient is finite, else ``old`` (the step is skipped); and the
        next loss scale."""
        finite = all_finite(grads)
        chosen = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        return chosen, self.adjust(finite)

    def metrics(self) -> dict[str, clu.metrics.Metric]:
        return {"loss_scale": clu.metrics.LastValue(value=self.loss_scale.astype(jnp.float32))}


@flax.struct.dataclass
class DynamicLossScale(StaticLossScale):
    """A scale that halves on a non-finite step and doubles after ``growth_interval`` finite
    steps in a row (the shape of DeepMind's ``jmp.DynamicLossScale``); kept in
    ``TrainState.loss_scale``, so it is checkpointed."""

    if TYPE_CHECKING:  # flax.struct.dataclass adds it

        def replace(self, **changes: object) -> Self: ...

    good_steps: jax.Array = None  # type: ignore[assignment]  # set by create()
    growth_interval: int = flax.struct.field(pytree_node=False, default=2000)
    factor: float = flax.struct.field(pytree_node=False, default=2.0)
    min_scale: float = flax.struct.field(pytree_node=False, default=1.0)

    def adjust(self, finite: jax.Array) -> DynamicLossScale:
        """The next state: halve on a non-finite step, grow after ``growth_interval`` good ones."""
        grow = self.good_steps + 1 >= self.growth_interval
        scale = jnp.where(
            finite,
            jnp.where(grow, self.loss_scale * self.factor, self.loss_scale),
            jnp.maximum(self.loss_scale / self.factor, self.min_scale),
        )
        good_steps = jnp.where(finite & ~grow, self.good_steps + 1, 0)
        return self.replace(loss_scale=scale.astype(jnp.float32), good_steps=good_steps.astype(jnp.int32))


LossScale = NoLossScale | StaticLossScale | DynamicLossScale


def all_finite(tree: PyTree) -> jax.Array:
    """Whether every element of every leaf is finite (a scalar boolean)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.stack(leaves).all() if leaves else jnp.array(True)


_ARRAYS = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)  # leaves with a dtype (tracers are jax.Arrays)


def _floating(x) -> bool:
    return isinstance(x, _ARRAYS) and jnp.issubdtype(x.dtype, jnp.floating)


def cast_floating(tree: PyTree, dtype) -> PyTree:
    """Casts the floating leaves of ``tree`` to ``dtype``; integer leaves are untouched."""
    return jax.tree.map(lambda x: x.astype(dtype) if _floating(x) and x.dtype != dtype else x, tree)


@dataclasses.dataclass(frozen=True)
class Precision:
    """A precision policy.

    Args:
        param_dtype: dtype of the stored (master) parameters.
        compute_dtype: dtype the parameters and floating inputs are cast to for the model call.
        output_dtype: dtype of the model's floating outputs, in which loss and metrics run.
        loss_scale: ``None`` (no scaling), ``"dynamic"``, or a number for a static scale.
        initial_scale: the first dynamic scale.
        growth_interval: finite steps in a row before a dynamic scale doubles.
    """

    param_dtype: DTypeLike = jnp.float32
    compute_dtype: DTypeLike = jnp.float32
    output_dtype: DTypeLike = jnp.float32
    loss_scale: str | float | None = None
    initial_scale: float = 2.0**15
    growth_interval: int = 2000

    def __post_init__(self):
        dtypes = {
            "param_dtype": self.param_dtype,
            "compute_dtype": self.compute_dtype,
            "output_dtype": self.output_dtype,
        }
        for field, value in dtypes.items():
            dtype = np.dtype(value)
            if not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(f"Precision.{field} must be a floating dtype; received {dtype}.")
            object.__setattr__(self, field, dtype)
        if not (self.loss_scale is None or self.loss_scale == "dynamic" or isinstance(self.loss_scale, (int, float))):
            raise ValueError(f"loss_scale must be None, 'dynamic' or a number; received {self.loss_scale!r}.")

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != self.param_dtype

    def init_loss_scale(self) -> LossScale:
        """The loss-scale state a fresh ``TrainState`` starts with."""
        if self.loss_scale is None:
            return NoLossScale()
        if self.loss_scale == "dynamic":
            return DynamicLossScale(
                loss_scale=jnp.asarray(self.initial_scale, jnp.float32),
                good_steps=jnp.zeros((), jnp.int32),
                growth_interval=self.growth_interval,
            )
        return StaticLossScale(loss_scale=jnp.asarray(self.loss_scale, jnp.float32))

    def wrap_apply(self, apply: Apply) -> Apply:
        """``apply`` with parameters and floating inputs cast to the compute dtype and floating
        outputs cast to the output dtype. Modules that set their own ``dtype`` still compute
        in it: Flax layers cast their inputs to their declared dtype."""
        if self.compute_dtype == self.param_dtype == self.output_dtype == np.dtype(jnp.float32):
            return apply

        def cast_apply(params, model_state, x, *, rng, train, **options):
            outputs, new_model_state = apply(
                cast_floating(params, self.compute_dtype),
                model_state,
                cast_floating(x, self.compute_dtype),
                rng=rng,
                train=train,
                **options,
            )
            # model state (batch statistics) keeps its stored dtypes from step to step (sown losses are not state)
            new_model_state, sown = split_sown(new_model_state)
            new_model_state = jax.tree.map(
                lambda new, old: new.astype(old.dtype) if isinstance(old, _ARRAYS) else new,
                new_model_state,
                model_state,
            )
            if sown:
                new_model_state = {**new_model_state, LOSSES: sown}
            return cast_floating(outputs, self.output_dtype), new_model_state

        return cast_apply


PRECISIONS = {
    "fp32": Precision(),
    "float32": Precision(),
    "32-true": Precision(),
    "bf16": Precision(compute_dtype=jnp.bfloat16),
    "bf16-mixed": Precision(compute_dtype=jnp.bfloat16),
    "mixed_bfloat16": Precision(compute_dtype=jnp.bfloat16),
    "fp16": Precision(compute_dtype=jnp.float16, loss_scale="dynamic"),
    "16-mixed": Precision(compute_dtype=jnp.float16, loss_scale="dynamic"),
    "mixed_float16": Precision(compute_dtype=jnp.float16, loss_scale="dynamic"),
}


def get_precision(precision: str | Precision | None) -> Precision:
    """A :class:`Precision` from a name or an instance; unknown names list the known ones."""
    if precision is None:
        return PRECISIONS["fp32"]
    if isinstance(precision, Precision):
        return precision
    if isinstance(precision, str) and precision in PRECISIONS:
        return PRECISIONS[precision]
    raise ValueError(
        f"Unknown precision {precision!r}. Known names: {', '.join(PRECISIONS)}; or pass "
        "tk.Precision(param_dtype, compute_dtype, output_dtype, loss_scale=...)."
    )
