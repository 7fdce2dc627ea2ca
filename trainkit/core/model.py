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

import contextlib
import dataclasses
import functools
import inspect
import zlib
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, Protocol, cast

import jax
import numpy as np
from flax import linen as nn
from flax import nnx

from trainkit.core.frozen_statistics import freeze_nnx_layers
from trainkit.core.lora import LoRA
from trainkit.core.sown import LOSSES
from trainkit.core.state import check_tree_matches
from trainkit.core.tree import PyTree, leaf_name

# Keyword names of ``__call__`` that switch training behaviour, and whether they mean
# "training" (True) or its negation (False).
_TRAIN_FLAGS = {"train": True, "training": True, "is_training": True, "deterministic": False}
#: How the train flags are named in messages.
TRAIN_FLAG_NAMES = ", ".join(_TRAIN_FLAGS)
#: A module's place in the model: linen's attribute names, or NNX's path parts (names, list indices).
ModulePath = tuple[Hashable, ...]
#: the model a Trainer takes: a Flax module, linen or NNX
Model = nn.Module | nnx.Module
#: A parameter's partitioning names, one per axis (``None``: that axis not named).
AxisNames = tuple[str | None, ...]
#: A logical axis rule ``(logical name, mesh axis or axes)``, as ``flax.linen.logical_axis_rules`` takes it.
LogicalRule = tuple[str, str | tuple[str, ...] | None]


class ModuleCall(NamedTuple):
    """One module of a model's forward pass: its path of attribute names (``()``: the model),
    its class name, and its output's shapes (``jax.ShapeDtypeStruct``s; ``None`` unknown)."""

    path: ModulePath
    kind: str
    output: PyTree


def _shapes(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


class ModelAdapter(Protocol):
    """What the rest of trainkit needs from a model (``module``: the user's own)."""

    @property
    def module(self) -> Model: ...

    def init(self, rng: jax.Array, x: PyTree) -> tuple[PyTree, PyTree]: ...

    def apply(
        self, params: PyTree, model_state: PyTree, x: PyTree, *, rng: jax.Array, train: bool, method: str | None = None
    ) -> tuple[PyTree, PyTree]:
        """``(outputs, new_model_state)`` of ``__call__``, or of the module's method ``method``."""
        ...

    def param_axes(self, x: PyTree) -> dict[str, AxisNames]:
        """The parameters' partitioning annotations ``{path: names}`` (empty without any)."""
        ...

    def module_calls(self, params: PyTree, model_state: PyTree, x: PyTree) -> list[ModuleCall]:
        """Every module of an eval-mode forward pass on ``x`` (traced, nothing computed), in
        the order they are entered, each once."""
        ...

    def unswitched_layers(self, params: PyTree, model_state: PyTree, x: PyTree) -> list[str]:
        """The layers that behave differently in training (dropout, batch statistics) but that
        trainkit cannot switch, since the model takes no train flag it knows (empty: none)."""
        ...

    def batch_statistics_layers(self, params: PyTree, model_state: PyTree, x: PyTree, axis: str) -> list[str]:
        """The layers that normalise a training batch by its own statistics without reducing
        them over the device ``axis``: under ``jax.pmap`` each device's rows alone (empty: none)."""
        ...


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


def _split_inputs(x: PyTree, parameters: dict[str, inspect.Parameter]) -> tuple[tuple[PyTree, ...], dict[str, PyTree]]:
    """A dict whose keys are all argument names of ``__call__`` is passed as keywords."""
    if isinstance(x, dict) and x and all(k in parameters for k in x):
        return (), dict(x)
    return (x,), {}


def bind_inputs(module: object, method: str | None, inputs: tuple[PyTree, ...], keywords: dict[str, PyTree]) -> PyTree:
    """The ``x`` :meth:`ModelAdapter.apply` takes for a call of the module's ``method`` (``None``:
    ``__call__``) on these inputs: one input as it is, several (or keywords) as a dict by the
    method's argument names, which ``apply`` passes as keywords.

    >>> class Conditional(nn.Module):
    ...     def __call__(self, z, labels): ...
    >>> sorted(bind_inputs(Conditional(), None, (1, 2), {}))
    ['labels', 'z']
    """
    if len(inputs) == 1 and not keywords:
        return inputs[0]
    call = model_method(module, "__call__" if method is None else method)
    parameters = [p for p in list(_call_parameters(call).values())[1:] if p.name not in _TRAIN_FLAGS]  # after self
    try:
        bound = inspect.Signature(parameters).bind_partial(*inputs, **keywords)
    except TypeError as error:
        names = [p.name for p in parameters]
        raise TypeError(
            f"state.apply(params, model_state, *inputs, method={method!r}): {type(module).__name__}."
            f"{method or '__call__'} takes {names}, and {error}."
        ) from None
    return dict(bound.arguments)


class LinenModel:
    """Adapter for a ``flax.linen.Module``."""

    def __init__(self, module: nn.Module):
        self.module = module
        self._parameters = _call_parameters(type(module).__call__)

    def _call(self, variables, x, train, method: str | None = None, **apply_kwargs):
        parameters = self._parameters if method is None else _call_parameters(model_method(self.module, method))
        args, kwargs = _split_inputs(x, parameters)
        kwargs.update(_train_kwarg(parameters, train))
        if method is not None:
            apply_kwargs["method"] = method
        return self.module.apply(variables, *args, **kwargs, **apply_kwargs)

    def _boxed_init(self, rng: jax.Array, x: PyTree) -> dict[str, PyTree]:
        params_rng, dropout_rng = jax.random.split(rng)
        args, kwargs = _split_inputs(x, self._parameters)
        kwargs.update(_train_kwarg(self._parameters, False))
        return dict(self.module.init({"params": params_rng, "dropout": dropout_rng}, *args, **kwargs))

    def init(self, rng: jax.Array, x: PyTree) -> tuple[PyTree, PyTree]:
        variables = nn.meta.unbox(self._boxed_init(rng, x))  # partitioning names: see param_axes
        params = variables.pop("params", {})
        variables.pop(LOSSES, None)  # losses the model sows are each call's, not state (core/sown.py)
        return params, variables

    def param_axes(self, x: PyTree) -> dict[str, AxisNames]:
        """``{"Dense_0/kernel": ("embed", "mlp")}``: the names of the parameters created with
        ``nn.with_logical_partitioning`` or ``nn.with_partitioning`` (traced, not run)."""
        boxed = jax.eval_shape(self._boxed_init, jax.random.PRNGKey(0), x)
        return _annotations(boxed.get("params", {}), lambda leaf: isinstance(leaf, nn.meta.AxisMetadata))

    def module_calls(self, params: PyTree, model_state: PyTree, x: PyTree) -> list[ModuleCall]:
        """Every module called (parameter-free ones too), recorded by ``nn.intercept_methods``."""
        return [
            ModuleCall(path, type(module).__name__, out) for path, module, out in self._called(params, model_state, x)
        ]

    def unswitched_layers(self, params: PyTree, model_state: PyTree, x: PyTree) -> list[str]:
        """Dropout (of a non-zero rate) and BatchNorm layers of a model whose ``__call__`` takes
        none of the train flags trainkit sets: they would stay in one mode in training and
        evaluation alike (traced, nothing computed). A layer fixed in evaluation mode when it
        was built (``deterministic=True``, ``use_running_average=True``) is left out."""
        if _train_kwarg(self._parameters, True):
            return []

        def switches(module: nn.Module) -> bool:
            if isinstance(module, nn.BatchNorm):
                return module.use_running_average is not True
            return isinstance(module, nn.Dropout) and module.rate > 0 and module.deterministic is not True

        called = self._called(params, model_state, x)
        found = [_layer_name(path, module) for path, module, _ in called if switches(module)]
        if found:
            return found
        for name, parameter in self._parameters.items():  # a train flag under another name (``mode``)
            if isinstance(parameter.default, bool) and parameter.kind is not parameter.VAR_KEYWORD:
                flipped = self._called(params, model_state, x, flags={name: not parameter.default})
                found = [_layer_name(p, m) for p, m, _ in flipped if switches(m)]
                if found:
                    return [f"{layer}, switched by `{name}`" for layer in found]
        return []

    def batch_statistics_layers(self, params: PyTree, model_state: PyTree, x: PyTree, axis: str) -> list[str]:
        """The BatchNorm layers of a training step that normalise by the statistics of the rows
        they see without reducing them over the device ``axis`` (``axis_name=axis``)."""
        called = self._called(params, model_state, x, train=True, axis=axis)
        return [_layer_name(path, m) for path, m, _ in called if isinstance(m, nn.BatchNorm) and m.axis_name != axis]

    def _called(
        self,
        params: PyTree,
        model_state: PyTree,
        x: PyTree,
        *,
        train: bool = False,
        axis: str | None = None,
        flags: dict[str, bool] | None = None,
    ) -> list[tuple[ModulePath, nn.Module, PyTree]]:
        """Every module whose ``__call__`` a forward pass enters, once each, parents before their
        children: its path, the module and its output's shapes (traced, nothing computed; as
        one device of a named ``axis``, which a layer may reduce over; ``flags``: keywords of
        ``__call__`` passed as given, the train flags left out)."""
        calls: dict[ModulePath, tuple[ModulePath, nn.Module, PyTree] | None] = {}

        def record(call, args, kwargs, context):
            path = tuple(context.module.path)
            if context.method_name != "__call__" or path in calls:
                return call(*args, **kwargs)
            calls[path] = None  # entered: parents before their children
            out = call(*args, **kwargs)
            calls[path] = (path, context.module, _shapes(out))
            return out

        def forward(params, model_state, x):
            with nn.intercept_methods(record):
                if flags:
                    args, kwargs = _split_inputs(x, self._parameters)
                    variables, rngs = {"params": params, **model_state}, _linen_streams(jax.random.PRNGKey(0))
                    keywords: dict[str, Any] = {**kwargs, **flags, "rngs": rngs}  # the user's __call__ keywords
                    return self.module.apply(variables, *args, **keywords)
                return self.apply(params, model_state, x, rng=jax.random.PRNGKey(0), train=train)[0]

        if axis is not None:
            x = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *np.shape(a)), a.dtype), x)
            forward = jax.vmap(forward, in_axes=(None, None, 0), axis_name=axis)
        jax.eval_shape(forward, params, model_state, x)
        return [call for call in calls.values() if call is not None]

    def apply(self, params, model_state, x, *, rng, train, method=None):
        """The model's call; losses it sows come back in the model state under ``"losses"`` (core/sown.py)."""
        variables = {"params": params, **model_state}
        writable = [*model_state, LOSSES] if train else [LOSSES]
        out, updates = self._call(variables, x, train, method, rngs=_linen_streams(rng), mutable=writable)
        updates = dict(updates)
        if not updates.get(LOSSES):
            updates.pop(LOSSES, None)
        return out, {**model_state, **updates}


class NNXModel:
    """Adapter for a ``flax.nnx.Module``.

    The module is split once into a graph definition, its ``nnx.Param`` state, its
    random-stream state and everything else (``BatchStat`` ...). Parameters and model state
    travel as plain nested dicts; each call merges them into a fresh module, switches it to
    train or eval mode and reseeds its ``dropout`` stream from the step's key.
    """

    def __init__(self, module: nnx.Module):
        self.module = module
        parts: tuple[Any, ...] = nnx.split(module, nnx.Param, nnx.RngState, ...)
        self._graphdef, self._params, self._rng_state, self._rest = parts
        self._rng_tags = _stream_tags(self._rng_state)
        self._parameters = _call_parameters(type(module).__call__)
        if "rngs" in self._parameters:
            raise TypeError(
                f"{type(module).__name__}.__call__ takes rngs, which trainkit does not pass: it draws each step's "
                "random numbers from the streams the module holds, reseeded every step. Give the layers their "
                "streams when the model is built and drop rngs from __call__: nnx.Dropout(0.5, rngs=rngs) in "
                "__init__(self, ..., rngs: nnx.Rngs), then self.dropout(x) in __call__ (docs/quickstart.md)."
            )

    def init(self, rng: jax.Array | None, x: PyTree) -> tuple[PyTree, PyTree]:
        del rng, x  # an NNX module is initialised when it is constructed
        return nnx.to_pure_dict(self._params), nnx.to_pure_dict(self._rest)

    def param_axes(self, x: PyTree) -> dict[str, AxisNames]:
        """The names of the parameters created with ``out_sharding`` metadata (Flax 0.12's name;
        ``sharding_names`` and ``sharding`` are read too), e.g. ``kernel_metadata=...``."""
        del x
        return _annotations(self._params, lambda leaf: isinstance(leaf, nnx.Variable))

    def module_calls(self, params: PyTree, model_state: PyTree, x: PyTree) -> list[ModuleCall]:
        """Every submodule called in an eval-mode forward pass, in the order it was entered, with
        its output's shapes (traced, nothing computed). NNX has no method interceptor: each
        module class's ``__call__`` is wrapped for the duration of the trace, recording the
        calls of this model's own instances only; a submodule never called is listed after them
        without a shape."""
        calls: dict[ModulePath, ModuleCall | None] = {}

        def forward(params, model_state, x):
            module = self.merge(params, model_state)
            module.eval()
            found = [(tuple(path), m) for path, m in nnx.iter_modules(module)]
            with _recording_calls({type(m) for _, m in found}, {id(m): path for path, m in found}, calls):
                args, kwargs = _split_inputs(x, self._parameters)
                return module(*args, **kwargs)

        jax.eval_shape(forward, params, model_state, x)
        entered = [call for call in calls.values() if call is not None]
        never = [
            ModuleCall(tuple(path), type(m).__name__, None)
            for path, m in nnx.iter_modules(self.module)
            if tuple(path) not in calls
        ]
        return entered + never

    def unswitched_layers(self, params: PyTree, model_state: PyTree, x: PyTree) -> list[str]:
        """None: ``module.train()`` / ``module.eval()`` switch every NNX layer's mode."""
        del params, model_state, x
        return []

    def batch_statistics_layers(self, params: PyTree, model_state: PyTree, x: PyTree, axis: str) -> list[str]:
        """The ``nnx.BatchNorm`` layers that do not reduce their statistics over ``axis``."""
        del params, model_state, x
        layers = nnx.iter_modules(self.module)
        return [_layer_name(tuple(p), m) for p, m in layers if isinstance(m, nnx.BatchNorm) and m.axis_name != axis]

    def merge(self, params: PyTree, model_state: PyTree) -> nnx.Module:
        """A module holding ``params`` and ``model_state`` (copies of the templates)."""
        copy = lambda tree: jax.tree.map(lambda v: v, tree)  # noqa: E731
        param_state, rest = copy(self._params), copy(self._rest)
        nnx.replace_by_pure_dict(param_state, params)
        nnx.replace_by_pure_dict(rest, model_state)
        module: nnx.Module = nnx.merge(self._graphdef, param_state, copy(self._rng_state), rest)
        return module

    def apply(self, params, model_state, x, *, rng, train, method=None):
        module = self.merge(params, model_state)
        module.train() if train else module.eval()
        if train:
            freeze_nnx_layers(module)  # the frozen BatchNorms (core/frozen_statistics.py) stay in inference mode
        if self._rng_tags:  # every stream, whatever the user's Rngs named it: new masks each step
            keys: dict[str, Any] = {tag: _stream_key(rng, tag) for tag in self._rng_tags}  # a stream per user's name
            nnx.reseed(module, **keys)
        call = module if method is None else functools.partial(model_method(module, method), module)
        args, kwargs = _split_inputs(x, self._parameters if method is None else _call_parameters(call))
        out = call(*args, **kwargs)
        rest = nnx.split(module, nnx.Param, nnx.RngState, ...)[-1]
        return out, (nnx.to_pure_dict(rest) if train else model_state)


@contextlib.contextmanager
def _recording_calls(classes: set[type], paths: dict[int, ModulePath], calls: dict[ModulePath, ModuleCall | None]):
    """Each class's ``__call__`` wrapped while the context lasts: a call of an instance in
    ``paths`` (by ``id``) is recorded in ``calls`` by its path, parents before children."""
    originals = {cls: cls.__dict__.get("__call__") for cls in classes}

    def wrapped(original):
        @functools.wraps(original)
        def call(self, *args, **kwargs):
            path = paths.get(id(self))
            if path is None or path in calls:
                return original(self, *args, **kwargs)
            calls[path] = None  # entered
            out = original(self, *args, **kwargs)
            calls[path] = ModuleCall(path, type(self).__name__, _shapes(out))
            return out

        return call

    try:
        for cls in classes:
            cls.__call__ = wrapped(cls.__call__)  # type: ignore[method-assign]  # wrapped while traced, put back below
        yield
    finally:
        for cls, original in originals.items():
            if original is None:
                del cls.__call__  # inherited: the base's again
            else:
                cls.__call__ = original  # type: ignore[method-assign]  # the class as it was


def model_method(module: object, name: object) -> Callable[..., Any]:
    """The method ``name`` of the module's class (``apply(..., method="decode")``); a clear error
    naming the methods it has for any other name.

    >>> model_method(nn.Dense(2), "nope")
    Traceback (most recent call last):
    ValueError: method='nope' is not a method of the model (Dense); its methods are ['__call__'].
    """
    found = next((vars(c)[name] for c in type(module).__mro__ if isinstance(name, str) and name in vars(c)), None)
    if found is None or not callable(found) or isinstance(found, type):
        fields = {f.name for f in dataclasses.fields(cast(Any, module))} if dataclasses.is_dataclass(module) else set()
        own = [k for k, v in vars(type(module)).items() if inspect.isfunction(v) and k not in fields]
        public = sorted(k for k in own if k == "__call__" or not k.startswith("_") and k != "setup")
        raise ValueError(
            f"method={name!r} is not a method of the model ({type(module).__name__}); its methods are {public}."
        )
    method: Callable[..., Any] = found
    return method


def _layer_name(path: tuple[object, ...], module: object) -> str:
    """``Block_0/BatchNorm_0 (BatchNorm)``: a layer's path and class, for messages."""
    return f"{'/'.join(map(str, path)) or 'the model'} ({type(module).__name__})"


def _stream_tags(rng_state: PyTree) -> tuple[str, ...]:
    """The tags of an NNX module's random streams (``nnx.Rngs(0)`` gives a layer the
    ``"default"`` stream, ``nnx.Rngs(0, dropout=1)`` a ``"dropout"`` one)."""
    leaves = jax.tree.leaves(rng_state, is_leaf=lambda leaf: isinstance(leaf, nnx.Variable))
    return tuple(sorted({leaf.tag for leaf in leaves if isinstance(leaf, nnx.RngKey)}))


def _linen_streams(rng: jax.Array) -> dict[str, jax.Array]:
    """A linen model's random streams for one call: ``"dropout"`` the step's key; any other it
    asks for (``self.make_rng("noise")``, a VAE's) draws from a ``"params"`` stream folded from
    it (linen's fallback for a stream not passed), each call's draws distinct.

    >>> import flax.linen as nn, jax.numpy as jnp
    >>> class Noisy(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return x + jax.random.normal(self.make_rng("noise"), x.shape)
    >>> out = Noisy().apply({}, jnp.zeros(2), rngs=_linen_streams(jax.random.PRNGKey(0)))
    >>> out.shape, bool((out != 0).all())
    ((2,), True)
    """
    return {"dropout": rng, "params": _stream_key(rng, "params")}


def _stream_key(rng: jax.Array, tag: str) -> jax.Array:
    """The step's key for the stream ``tag``: the key itself for ``"dropout"``, a fold of it
    by the tag's checksum for any other stream (streams stay independent)."""
    return rng if tag == "dropout" else jax.random.fold_in(rng, zlib.crc32(tag.encode()) & 0x7FFFFFFF)


def _names(leaf: object) -> tuple[str | None, ...] | None:
    """A variable's partitioning names: a linen box's ``names``, an NNX variable's
    ``out_sharding`` / ``sharding_names`` / ``sharding`` metadata."""
    names = getattr(leaf, "names", None)
    if names is None and isinstance(leaf, nnx.Variable):
        metadata = leaf.get_metadata()
        names = next((metadata[k] for k in ("out_sharding", "sharding_names", "sharding") if metadata.get(k)), None)
    return None if names is None else tuple(names)


def _annotations(params: PyTree, is_variable) -> dict[str, AxisNames]:
    found = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_variable)[0]:
        names = _names(leaf)
        if names is not None:
            found[leaf_name(path)] = names
    return found


def call_error_hint(error: Exception) -> str:
    """What to check after the model raised ``error`` on the first batch: a mode flag never set
    (a linen Dropout or BatchNorm without ``deterministic`` / ``use_running_average``), a key the
    inputs lack, or, for a shape error only, the input's axes.

    >>> call_error_hint(ValueError('Parameter "deterministic" must be passed to the constructor or at call time.'))[:31]
    "Give the model's __call__ a tra"
    >>> "channels-first" in call_error_hint(ZeroDivisionError("integer division or modulo by zero"))
    True
    """
    message = str(error)
    if "Multiple candidate params found" in message:  # qwix's LoRA: which kernel an einsum reads
        return (
            "LoRA (qwix) could not tell which parameter a jnp.einsum reads: several of the module's parameters "
            "share its shape, and the kernel reaches the einsum as a new value (a quantised base, "
            "quantize_base=..., reaches it dequantised), not as the parameter itself. Restrict "
            "tk.LoRA(targets=...) to the other modules (targets='Dense'), or adapt a float base."
        )
    if any(word in message for word in ("deterministic", "use_running_average", '"batch_stats" is immutable')):
        return (
            "Give the model's __call__ a train flag and pass it on: `def __call__(self, x, train: bool = False)` "
            "with nn.Dropout(rate, deterministic=not train) and nn.BatchNorm(use_running_average=not train). "
            f"trainkit sets any one of {TRAIN_FLAG_NAMES} (deterministic=True means evaluation)."
        )
    if isinstance(error, TypeError) and "required positional argument" in message:
        return (
            "A tuple or list given as x reaches the model as ONE argument (Keras's multi-input x): "
            "`def __call__(self, inputs)` with `first, second = inputs`, or pass a dict whose keys name "
            "__call__'s arguments (x={'first': a, 'second': b}: passed as keyword arguments)."
        )
    if isinstance(error, KeyError):
        return (
            f"The model looked up {message}, which its inputs lack: a dict given as x is passed to the model as it "
            "is (or as keyword arguments when every key names an argument of __call__); check the dict's keys."
        )
    shape_words = ("shape", "dimension", "rank", "dot_general", "incompatible", "division by zero")
    if isinstance(error, ZeroDivisionError) or any(word in message.lower() for word in shape_words):
        return (
            "Check the input shape the model expects: a missing channel axis (images of shape (N, H, W) for a "
            "Conv: pass x[..., None]), or channels-first data (torch's (N, C, H, W): Flax's Conv takes "
            "(N, H, W, C), x.transpose(0, 2, 3, 1))."
        )
    return "Call the model on a few rows yourself (module.apply or module(x)) to see where it fails."


def param_axes(adapter: ModelAdapter, x: PyTree) -> dict[str, AxisNames]:
    """The model's parameter annotations ``{path: names}`` (empty for an adapter without any)."""
    return adapter.param_axes(x)


def adapt_model(model: object) -> ModelAdapter:
    """Wraps a Flax module; raises a ``TypeError`` for anything else (a module class named
    with the call that makes an instance)."""
    if isinstance(model, nn.Module):
        return LinenModel(model)
    if isinstance(model, nnx.Module):
        return NNXModel(model)
    if isinstance(model, type) and issubclass(model, (nn.Module, nnx.Module)):
        call = f"{model.__name__}(rngs=nnx.Rngs(0))" if issubclass(model, nnx.Module) else f"{model.__name__}()"
        raise TypeError(
            f"trainkit.Trainer needs a module instance; received the class {model.__name__} itself. "
            f"Instantiate it: Trainer({call}, ...)."
        )
    raise TypeError(
        f"trainkit.Trainer needs a Flax module; received an object of type "
        f"{type(model).__module__}.{type(model).__qualname__}. Pass a flax.linen.Module "
        "(e.g. `class MLP(nn.Module)`) or a flax.nnx.Module instance. For a plain function, "
        "wrap it in a linen Module whose __call__ calls it."
    )


def with_lora(adapter: ModelAdapter, lora: LoRA, seed: int = 0) -> ModelAdapter:
    """The adapter of the same module with ``lora``'s adapters (qwix's interception): a linen
    module at once, an NNX module at its first input (qwix runs it once to create them; ``seed``
    draws their initial A)."""
    if isinstance(adapter, LinenModel):
        return LinenModel(lora.wrap(adapter.module))
    if isinstance(adapter, NNXModel):
        return NNXLoRAModel(adapter.module, lora, seed)
    raise TypeError(f"Trainer(lora=...) adapts flax.linen and flax.nnx modules; received {type(adapter).__name__}.")


class NNXLoRAModel(NNXModel):
    """An NNX module with qwix's LoRA adapters, created from the first input the model sees
    (:meth:`init`): until then it has no parameters to split."""

    def __init__(self, module: nnx.Module, lora: LoRA, seed: int):
        self.base, self.lora, self.seed = module, lora, seed
        self._ready = False

    def _wrap(self, x: PyTree) -> None:
        if self._ready:
            return
        if x is None:
            raise RuntimeError("An NNX model with LoRA adapters needs an input first: call trainer.init(sample).")
        args, kwargs = _split_inputs(x, _call_parameters(type(self.base).__call__))
        NNXModel.__init__(self, self.lora.wrap_nnx(self.base, args, kwargs, self.seed))
        self._ready = True

    def init(self, rng: jax.Array | None, x: PyTree) -> tuple[PyTree, PyTree]:
        self._wrap(x)
        return super().init(rng, x)

    def param_axes(self, x: PyTree) -> dict[str, AxisNames]:
        self._wrap(x)
        return super().param_axes(x)


def starting_variables(adapter: ModelAdapter, given: PyTree, first_row: PyTree) -> tuple[PyTree, PyTree] | None:
    """``(params, model_state)`` to start from: ``given`` variables (``{"params": ...,
    "batch_stats": ...}`` or a bare parameter tree, checked against the model's own), an NNX
    module's arrays, or ``None`` (a linen module initialises itself)."""
    if given is None:
        return adapter.init(None, first_row) if isinstance(adapter, NNXModel) else None
    abstract = jax.eval_shape(adapter.init, jax.random.PRNGKey(0), first_row)
    if isinstance(given, dict) and "params" in given:
        variables = (given["params"], {k: v for k, v in given.items() if k != "params"})
    else:
        variables = (given, {})
    check_tree_matches("params=", abstract, variables)
    params, model_state = jax.tree.map(np.asarray, variables)
    return params, model_state
