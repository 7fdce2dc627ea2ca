"""Rematerialisation (activation checkpointing) without editing the model's code.

``remat=`` takes

- ``None``: no remat;
- ``"full"``: every direct submodule of the model is rematerialised and saves nothing, so the
  backward pass recomputes its activations;
- ``"dots"`` / ``"dots_no_batch"``: the same, but matrix products (all of them, or those
  without batch dimensions) are saved (``jax.checkpoint_policies``);
- a ``jax.checkpoint`` policy (any callable such as
  ``jax.checkpoint_policies.save_only_these_names("attn")``), applied the same way;
- a list of Flax submodule class names, e.g. ``["Block"]``: each call of such a submodule,
  at any depth, is rematerialised (nothing saved), e.g. every block of a transformer.

Submodule calls are intercepted (``flax.linen`` modules). A stateless submodule (only
``params``) is applied as a pure function whose backward pass recomputes its activations
inside a conditional on the incoming cotangent (:func:`recompute_in_backward`), so no compiler
can hoist the recomputation next to the forward pass; a submodule with mutable state (batch
statistics) goes through Flax's lifted ``nn.checkpoint``. The gradients equal those without
remat; with dropout, a rematerialised submodule draws its own (equally distributed) masks.

>>> resolve_remat("dots_no_batch").modules is None
True
>>> resolve_remat(["Block"]).modules
frozenset({'Block'})
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from trainkit.core.model import LinenModel, ModelAdapter, ModulePath
from trainkit.core.trace_context import current, under
from trainkit.core.tree import Apply, TreeFunction

P = ParamSpec("P")
R = TypeVar("R")

#: A ``jax.checkpoint`` policy: whether to save an intermediate (``jax.checkpoint_policies``).
Policy = Callable[..., bool]

POLICIES: dict[str, Policy | None] = {
    "full": None,  # save nothing
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


#: What ``Trainer(remat=...)`` takes: a policy name, a ``jax.checkpoint`` policy, or submodule class names.
Remat = str | Callable[..., bool] | Sequence[str] | frozenset[str] | None


@dataclasses.dataclass(frozen=True)
class RematSpec:
    """What to rematerialise: ``modules`` (class names; ``None`` = direct submodules) and the
    ``jax.checkpoint`` policy of what to save inside each."""

    policy: Policy | None
    modules: frozenset[str] | None


def resolve_remat(remat: Remat) -> RematSpec | None:
    """A :class:`RematSpec` from the forms ``Trainer(remat=...)`` accepts."""
    if remat is None:
        return None
    if isinstance(remat, str):
        if remat not in POLICIES:
            raise ValueError(
                f"Unknown remat policy {remat!r}. Known names: {', '.join(POLICIES)}; or pass a "
                "jax.checkpoint policy, or a list of Flax submodule class names such as ['Block']."
            )
        return RematSpec(POLICIES[remat], None)
    if isinstance(remat, (list, tuple, set, frozenset)) and remat and all(isinstance(n, str) for n in remat):
        return RematSpec(None, frozenset(remat))
    if callable(remat):
        return RematSpec(remat, None)
    raise TypeError(
        f"remat must be None, a policy name, a jax.checkpoint policy or a list of submodule "
        f"class names; received {remat!r}."
    )


@dataclasses.dataclass(frozen=True)
class _Inside:
    """The trace context's part of a rematerialised submodule being traced (none nests in it)."""


_INSIDE = _Inside()


def _is_dynamic(value: Any) -> bool:
    leaves = jax.tree.leaves(value)
    return bool(leaves) and all(isinstance(leaf, jax.Array) for leaf in leaves)


def _is_floating(value: Any) -> bool:
    return all(jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in jax.tree.leaves(value))


def recompute_in_backward(fn: TreeFunction, policy: Policy | None) -> TreeFunction:
    """``fn(variables, rng, *arrays)`` whose backward pass recomputes what ``policy`` does not
    save, inside a ``lax.cond`` on the incoming cotangent.

    Plain ``jax.checkpoint`` marks what to recompute, but a compiler may schedule the
    recomputation early, right after the forward pass, which keeps the activations alive
    anyway: XLA's CPU backend does (its temp bytes do not move). A conditional whose predicate
    reads the cotangent cannot run before the backward pass reaches it, and its operands'
    intermediates live only inside it (the idea of JAX's original remat lowering, PR #2391).
    Gradients are unchanged.
    """
    checkpointed = jax.checkpoint(fn, policy=policy or jax.checkpoint_policies.nothing_saveable)

    @jax.custom_vjp
    def call(variables, rng, *arrays):
        return fn(variables, rng, *arrays)

    def forward(variables, rng, *arrays):
        out, vjp = jax.vjp(lambda v, *a: checkpointed(v, rng, *a), variables, *arrays)
        return out, (vjp,)

    def backward(residuals, cotangent):
        (vjp,) = residuals
        leaf = jax.tree.leaves(cotangent)[0].reshape(-1)[0]
        always = (leaf == leaf) | jnp.isnan(leaf)  # True, but unknown to the compiler
        shapes = jax.eval_shape(vjp, cotangent)
        zeros = lambda _: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # noqa: E731
        grads = jax.lax.cond(always, vjp, zeros, cotangent)
        return (grads[0], None, *grads[1:])

    call.defvjp(forward, backward)
    return call


def _interceptor(spec: RematSpec):
    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if spec.modules is None:
            selected = len(module.scope.path) == 1  # a direct submodule of the model
        else:
            selected = type(module).__name__ in spec.modules
        if context.method_name != "__call__" or not selected or current(_Inside) is not None:
            return next_fun(*args, **kwargs)
        names = list(kwargs)
        values = list(args) + [kwargs[n] for n in names]
        dynamic = [_is_dynamic(v) for v in values]
        arrays = [v for v, d in zip(values, dynamic) if d]

        def call(mdl, *arrays):
            it = iter(arrays)
            full = [next(it) if d else v for v, d in zip(values, dynamic)]
            with under(_INSIDE):
                return mdl(*full[: len(args)], **dict(zip(names, full[len(args) :])))

        variables = module.variables
        if set(variables) <= {"params"} and all(_is_floating(a) for a in arrays):
            # stateless submodule: recompute inside the backward pass (see above)
            rng = module.make_rng("dropout") if module.scope.has_rng("dropout") else None
            unbound = module.clone(parent=None)

            def pure(variables, rng, *arrays):
                return unbound.apply(variables, *arrays, method=call, rngs=None if rng is None else {"dropout": rng})

            return recompute_in_backward(pure, spec.policy)(dict(variables), rng, *arrays)
        # submodules with mutable state (batch statistics): Flax's lifted checkpoint
        return nn.checkpoint(call, policy=spec.policy, prevent_cse=True)(module, *arrays)

    return intercept


def wrap_remat(adapter: ModelAdapter, remat: Remat) -> Apply:
    """The adapter's ``apply`` with the remat setting applied (unchanged for ``None``)."""
    spec = resolve_remat(remat)
    if spec is None:
        return adapter.apply
    if not isinstance(adapter, LinenModel):
        raise ValueError(
            f"remat={remat!r} needs a flax.linen module; this model is a "
            f"{type(adapter.module).__name__} (NNX). Wrap the submodules you want to "
            "rematerialise with nnx.remat in the model's code, and pass remat=None."
        )
    interceptor = _interceptor(spec)

    def apply(params, model_state, x, *, rng, train, **options):
        with nn.intercept_methods(interceptor):
            return adapter.apply(params, model_state, x, rng=rng, train=train, **options)

    return apply


def rematerialised(fn: Callable[P, R], remat: Remat) -> Callable[P, R]:
    """``fn`` (a training step) traced with ``remat`` applied to every linen module it calls:
    the remat a plan adds to a candidate (``strategy="auto"`` when nothing fits), on top of the
    trainer's own. ``remat=None``: ``fn`` itself.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> model = nn.Dense(2)
    >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> loss = lambda v, x: model.apply(v, x).sum()
    >>> grads = jax.grad(rematerialised(loss, ["Dense"]))(variables, jnp.ones((4, 3)))
    >>> bool(jnp.allclose(grads["params"]["kernel"], jax.grad(loss)(variables, jnp.ones((4, 3)))["params"]["kernel"]))
    True
    """
    spec = resolve_remat(remat)
    if spec is None:
        return fn
    interceptor = _interceptor(spec)

    @functools.wraps(fn)
    def traced(*args: P.args, **kwargs: P.kwargs) -> R:
        with nn.intercept_methods(interceptor):
            return fn(*args, **kwargs)

    return traced


def repeated_blocks(calls: Sequence[tuple[ModulePath, str]]) -> list[str]:
    """The class names to rematerialise for a model's repeated blocks, from its module calls
    (``(path, class name)``, as :meth:`~trainkit.core.model.ModelAdapter.module_calls` lists
    them): the outermost class called more than once at its outermost depth (a transformer's
    ``Block``, not the ``Dense`` layers inside it nor a head ``Dense`` beside them); empty when
    no submodule class repeats.

    >>> repeated_blocks([((), "LM"), (("Block_0",), "Block"), (("Block_0", "Dense_0"), "Dense"),
    ...                  (("Block_1",), "Block"), (("Block_1", "Dense_0"), "Dense"), (("head",), "Dense")])
    ['Block']
    >>> repeated_blocks([((), "MLP"), (("Dense_0",), "Dense"), (("Dense_1",), "Dense")])
    ['Dense']
    """
    depth: dict[str, int] = {}
    for path, kind in calls:
        if path:  # the model itself is not a block
            depth[kind] = min(depth.get(kind, len(path)), len(path))
    # called more than once at its outermost depth (a head Dense beside Dense layers in blocks is not a block)
    counts = {kind: sum(1 for path, k in calls if k == kind and len(path) == depth[kind]) for kind in depth}
    repeated = [kind for kind, count in counts.items() if count > 1]
    if not repeated:
        return []
    outermost = min(depth[kind] for kind in repeated)
    return sorted(kind for kind in repeated if depth[kind] == outermost)
