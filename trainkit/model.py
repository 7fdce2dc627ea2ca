"""Flax modules (linen and NNX) as a pure ``(init, apply)`` pair.

This is the only file that knows Flax exists. Everything else sees a
:class:`ModelAdapter`: ``init(rng, x) -> (params, model_state)`` and
``apply(params, model_state, x, rng=..., train=...) -> (outputs, model_state)``.

>>> import jax, jax.numpy as jnp, flax.linen as nn
>>> adapter = adapt_model(nn.Dense(3))
>>> params, model_state = adapter.init(jax.random.PRNGKey(0), jnp.ones((1, 2)))
>>> out, _ = adapter.apply(params, model_state, jnp.ones((4, 2)), rng=jax.random.PRNGKey(1), train=False)
>>> out.shape
(4, 3)
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import jax
import numpy as np
from flax import linen as nn
from flax import nnx

from trainkit.state import check_tree_matches

PyTree = Any

# Keyword names of ``__call__`` that switch training behaviour, and whether they mean
# "training" (True) or its negation (False).
_TRAIN_FLAGS = {"train": True, "training": True, "is_training": True, "deterministic": False}


class ModelAdapter(Protocol):
    """What the rest of trainkit needs from a model."""

    def init(self, rng: jax.Array, x: PyTree) -> tuple[PyTree, PyTree]: ...

    def apply(
        self, params: PyTree, model_state: PyTree, x: PyTree, *, rng: jax.Array, train: bool
    ) -> tuple[PyTree, PyTree]: ...


def _call_parameters(fn) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def _train_kwarg(parameters: dict[str, inspect.Parameter], train: bool) -> dict[str, bool]:
    for name, means_training in _TRAIN_FLAGS.items():
        if name in parameters:
            return {name: train if means_training else not train}
    return {}


def _split_inputs(x: PyTree, parameters: dict[str, inspect.Parameter]) -> tuple[tuple, dict]:
    """A dict whose keys are all argument names of ``__call__`` is passed as keywords."""
    if isinstance(x, dict) and x and all(k in parameters for k in x):
        return (), dict(x)
    return (x,), {}


class LinenModel:
    """Adapter for a ``flax.linen.Module``."""

    def __init__(self, module: nn.Module):
        self.module = module
        self._parameters = _call_parameters(type(module).__call__)

    def _call(self, variables, x, train, **apply_kwargs):
        args, kwargs = _split_inputs(x, self._parameters)
        kwargs.update(_train_kwarg(self._parameters, train))
        return self.module.apply(variables, *args, **kwargs, **apply_kwargs)

    def init(self, rng: jax.Array, x: PyTree) -> tuple[PyTree, PyTree]:
        params_rng, dropout_rng = jax.random.split(rng)
        args, kwargs = _split_inputs(x, self._parameters)
        kwargs.update(_train_kwarg(self._parameters, False))
        variables = dict(self.module.init({"params": params_rng, "dropout": dropout_rng}, *args, **kwargs))
        params = variables.pop("params", {})
        return params, variables

    def apply(self, params, model_state, x, *, rng, train):
        variables = {"params": params, **model_state}
        if train and model_state:
            out, updates = self._call(variables, x, True, rngs={"dropout": rng}, mutable=list(model_state))
            return out, {**model_state, **dict(updates)}
        return self._call(variables, x, train, rngs={"dropout": rng}), model_state


class NNXModel:
    """Adapter for a ``flax.nnx.Module``.

    The module is split once into a graph definition, its ``nnx.Param`` state, its
    random-stream state and everything else (``BatchStat`` ...). Parameters and model state
    travel as plain nested dicts; each call merges them into a fresh module, switches it to
    train or eval mode and reseeds its ``dropout`` stream from the step's key.
    """

    def __init__(self, module: nnx.Module):
        self.module = module
        self._graphdef, self._params, self._rng_state, self._rest = nnx.split(module, nnx.Param, nnx.RngState, ...)
        self._parameters = _call_parameters(type(module).__call__)

    def init(self, rng: jax.Array, x: PyTree) -> tuple[PyTree, PyTree]:
        del rng, x  # an NNX module is initialised when it is constructed
        return nnx.to_pure_dict(self._params), nnx.to_pure_dict(self._rest)

    def merge(self, params: PyTree, model_state: PyTree) -> nnx.Module:
        """A module holding ``params`` and ``model_state`` (copies of the templates)."""
        copy = lambda tree: jax.tree.map(lambda v: v, tree)  # noqa: E731
        param_state, rest = copy(self._params), copy(self._rest)
        nnx.replace_by_pure_dict(param_state, params)
        nnx.replace_by_pure_dict(rest, model_state)
        return nnx.merge(self._graphdef, param_state, copy(self._rng_state), rest)

    def apply(self, params, model_state, x, *, rng, train):
        module = self.merge(params, model_state)
        module.train() if train else module.eval()
        try:
            nnx.reseed(module, dropout=rng)
        except (KeyError, ValueError, AttributeError):
            pass  # the module has no dropout stream
        args, kwargs = _split_inputs(x, self._parameters)
        out = module(*args, **kwargs)
        *_, rest = nnx.split(module, nnx.Param, nnx.RngState, ...)
        return out, (nnx.to_pure_dict(rest) if train else model_state)


def adapt_model(model: Any) -> ModelAdapter:
    """Wraps a Flax module; raises a ``TypeError`` for anything else."""
    if isinstance(model, nn.Module):
        return LinenModel(model)
    if isinstance(model, nnx.Module):
        return NNXModel(model)
    raise TypeError(
        f"trainkit.Trainer needs a Flax module; received an object of type "
        f"{type(model).__module__}.{type(model).__qualname__}. Pass a flax.linen.Module "
        "(e.g. `class MLP(nn.Module)`) or a flax.nnx.Module instance. For a plain function, "
        "wrap it in a linen Module whose __call__ calls it."
    )


def starting_variables(adapter: ModelAdapter, given: PyTree, first_row: PyTree) -> tuple[PyTree, PyTree] | None:
    """``(params, model_state)`` to start from: ``given`` variables (``{"params": ...,
    "batch_stats": ...}`` or a bare parameter tree, checked against the model's own), an NNX
    module's arrays, or ``None`` (a linen module initialises itself)."""
    if given is None:
        return adapter.init(None, None) if isinstance(adapter, NNXModel) else None
    abstract = jax.eval_shape(adapter.init, jax.random.PRNGKey(0), first_row)
    if isinstance(given, dict) and "params" in given:
        variables = (given["params"], {k: v for k, v in given.items() if k != "params"})
    else:
        variables = (given, {})
    check_tree_matches("params=", abstract, variables)
    return jax.tree.map(np.asarray, variables)
