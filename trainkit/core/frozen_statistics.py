"""Frozen means frozen: a batch-statistics layer (``BatchNorm``) whose parameters are all frozen
(``Trainer(trainable=...)``, a LoRA base) runs in inference mode while the model trains, as
Keras runs a ``BatchNorm`` with ``trainable=False``: it normalises by its running averages and
never updates them, so a frozen backbone's ``batch_stats`` stay as they were loaded.
``Trainer(frozen_statistics=False)`` keeps them training (batch statistics, running averages
updated).

The layers are found once from the parameters' paths; while a training step is traced,
:func:`statistics_frozen` makes them run with ``use_running_average=True`` (a linen method
interceptor; for NNX, :func:`freeze_nnx_layers` on the merged module).

>>> import flax.linen as nn, jax, jax.numpy as jnp
>>> class Net(nn.Module):
...     @nn.compact
...     def __call__(self, x, train=False):
...         return nn.Dense(2, name="head")(nn.BatchNorm(use_running_average=not train, name="bn")(x))
>>> variables = Net().init(jax.random.PRNGKey(0), jnp.ones((4, 3)))
>>> with statistics_frozen(frozenset({"bn"})):
...     _, updates = Net().apply(variables, jnp.arange(12.0).reshape(4, 3), train=True, mutable=["batch_stats"])
>>> bool((updates["batch_stats"]["bn"]["mean"] == 0).all())  # not updated: the layer ran in inference mode
True
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import ParamSpec, TypeVar

import flax.linen as nn
import jax
from flax import nnx

from trainkit.core.statistics import module_of
from trainkit.core.trace_context import current, under
from trainkit.core.tree import PyTree, leaf_name
from trainkit.internals.rebinding import field_set

P = ParamSpec("P")
R = TypeVar("R")


@dataclasses.dataclass(frozen=True)
class _Frozen:
    """The trace context's part naming the batch-statistics layers that run in inference mode."""

    layers: frozenset[str]


def _frozen() -> frozenset[str]:
    part = current(_Frozen)
    return frozenset() if part is None else part.layers


def frozen_layers(
    layer_paths: list[str], params: PyTree, trains: Callable[[str, PyTree], bool], order: Sequence[str] = ()
) -> frozenset[str]:
    """Of the batch-statistics layers at ``layer_paths`` (``"block/BatchNorm_0"``), those whose
    parameters all are frozen; a layer without parameters (``use_scale=False, use_bias=False``)
    is frozen when the module holding it is (it has parameters, and none of them trains), or else
    when the last module with parameters called before it (``order``: the modules' paths in the
    order they are entered) is frozen: the layer normalises what a frozen layer gave it."""
    decided = [
        (leaf_name(path), trains(leaf_name(path), leaf)) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    ]
    own: dict[str, list[bool]] = {}
    for name, train in decided:
        own.setdefault(module_of(name), []).append(train)

    def frozen(layer: str) -> bool:
        if own.get(layer):
            return not any(own[layer])
        parent = layer.rpartition("/")[0]
        around = [train for name, train in decided if parent and name.startswith(parent + "/")]
        if around and not any(around):
            return True
        before = list(order)[: list(order).index(layer)] if layer in order else []
        feeding = [path for path in before if own.get(path)]
        return bool(feeding) and not any(own[feeding[-1]])

    return frozenset(p for p in layer_paths if frozen(p))


def _interceptor(
    call: Callable[..., PyTree],
    args: tuple[PyTree, ...],
    kwargs: dict[str, PyTree],
    context: nn.module.InterceptorContext,
) -> PyTree:
    module = context.module
    if (
        context.method_name == "__call__"
        and isinstance(module, nn.BatchNorm)
        and "/".join(map(str, module.path)) in _frozen()
    ):
        if module.use_running_average is None:  # given at call time: given True instead
            return call(*args[:1], **{**kwargs, "use_running_average": True})
        with field_set(module, "use_running_average", True):  # given to the constructor: True for this call
            return call(*args, **kwargs)
    return call(*args, **kwargs)


@contextlib.contextmanager
def statistics_frozen(layers: frozenset[str]) -> Iterator[None]:
    """While it lasts (a step being traced), the batch-statistics layers at ``layers`` run in
    inference mode: linen's through a method interceptor, NNX's when :func:`freeze_nnx_layers`
    sees the merged module."""
    if not layers:
        yield
        return
    with under(_Frozen(layers)), nn.intercept_methods(_interceptor):
        yield


def freeze_nnx_layers(module: nnx.Module) -> None:
    """Switches the NNX ``BatchNorm`` layers :func:`statistics_frozen` names to inference mode
    (called after ``module.train()``)."""
    layers = _frozen()
    if not layers:
        return
    for path, layer in nnx.iter_modules(module):
        if isinstance(layer, nnx.BatchNorm) and "/".join(map(str, path)) in layers:
            layer.use_running_average = True


def with_frozen_statistics(compute_loss: Callable[P, R], layers: frozenset[str]) -> Callable[P, R]:
    """``compute_loss`` whose training calls run the ``layers`` in inference mode."""
    if not layers:
        return compute_loss

    def frozen(*args: P.args, **kwargs: P.kwargs) -> R:
        with statistics_frozen(layers):
            return compute_loss(*args, **kwargs)

    return frozen
