"""Optimizer state helpers: the learning rate inside ``optax.inject_hyperparams`` state, and an
exponential moving average (EMA) of the parameters kept in the optimizer state.

>>> import jax.numpy as jnp, optax
>>> tx = with_ema(optax.inject_hyperparams(optax.sgd)(learning_rate=0.5), momentum=0.5)
>>> params = {"w": jnp.zeros(())}
>>> state = tx.init(params)
>>> updates, state = tx.update({"w": jnp.array(-2.0)}, state, params)   # w: 0 -> 1, ema = 1
>>> updates, state = tx.update({"w": jnp.array(-2.0)}, state, {"w": jnp.array(1.0)})   # w: 1 -> 2
>>> float(learning_rate(state)), float(ema_params(state)["w"])
(0.5, 1.5)
>>> float(learning_rate(set_learning_rate(state, 0.25)))
0.25
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from trainkit.core.tree import PyTree
from trainkit.internals.jaxpr import Jaxpr, is_literal


def _is_injected(node: Any) -> bool:
    return isinstance(getattr(node, "hyperparams", None), dict)


def learning_rate(opt_state: PyTree) -> jax.Array | None:
    """The current learning rate when the optimizer exposes it (``optax.inject_hyperparams``)."""
    for node in jax.tree.leaves(opt_state, is_leaf=_is_injected):
        if _is_injected(node) and "learning_rate" in node.hyperparams:
            rate: jax.Array = node.hyperparams["learning_rate"]
            return rate
    return None


def injected(opt_state: PyTree) -> list[dict[str, jax.Array]]:
    """The ``hyperparams`` dicts of every ``optax.inject_hyperparams`` state (device arrays)."""
    return [node.hyperparams for node in jax.tree.leaves(opt_state, is_leaf=_is_injected) if _is_injected(node)]


def hyperparameters(opt_state: PyTree) -> dict[str, float]:
    """The injected scalar hyperparameters (``optax.inject_hyperparams``), as floats; also
    from the list :func:`injected` returns (fetched to the host)."""
    found: dict[str, float] = {}
    for hyperparams in opt_state if isinstance(opt_state, list) else injected(opt_state):
        found.update({k: float(f"{float(v):.7g}") for k, v in hyperparams.items() if jax.numpy.ndim(v) == 0})
    return found


def describe(opt_state: PyTree) -> str:
    """The optimizer's state types, outermost first (``ScaleByAdamState+ScaleByScheduleState``):
    optax transformations carry no name, their states do.

    >>> describe(optax.adam(1e-3).init({"w": jax.numpy.zeros(2)}))
    'ScaleByAdamState'
    """
    names: list[str] = []

    def visit(node: Any) -> None:
        name = type(node).__name__
        if _is_injected(node):
            names.append(f"inject_hyperparams({describe(node.inner_state)})")
        elif isinstance(node, tuple) and hasattr(node, "_fields"):
            if name not in ("EmptyState", "MaskedState") and name not in names:
                names.append(name)
        elif isinstance(node, (tuple, list)):
            for child in node:
                visit(child)

    visit(opt_state)
    return "+".join(names) or type(opt_state).__name__


def require_learning_rate(opt_state: PyTree) -> jax.Array:
    """:func:`learning_rate`, or a ``ValueError`` saying how to expose it."""
    rate = learning_rate(opt_state)
    if rate is None:
        raise ValueError(_NO_LEARNING_RATE)
    return rate


_NO_LEARNING_RATE = (
    "The optimizer does not expose its learning rate, so it cannot be read or changed "
    "(ReduceLROnPlateau, LearningRateScheduler, trainer.learning_rate). Build it with "
    "optax.inject_hyperparams, e.g. optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)."
)


def rate_is_scheduled(tx: optax.GradientTransformation, opt_state: PyTree, params: PyTree) -> bool:
    """Whether ``tx`` recomputes its injected learning rate at every update, whatever the state
    holds (a schedule given to ``optax.inject_hyperparams``): then setting it changes nothing.
    Traced on shapes (``opt_state`` and ``params`` may be ``jax.ShapeDtypeStruct``), nothing run:
    the rate after an update depends on the rate set before it, or not.

    >>> params = {"w": jnp.zeros(2)}
    >>> fixed = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    >>> scheduled = optax.inject_hyperparams(optax.sgd)(learning_rate=optax.constant_schedule(0.1))
    >>> [rate_is_scheduled(tx, tx.init(params), params) for tx in (fixed, scheduled)]
    [False, True]
    """
    rate = require_learning_rate(opt_state)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype), (opt_state, params))

    def rate_after(value, opt_state, params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return learning_rate(tx.update(zeros, set_learning_rate(opt_state, value), params)[1])

    closed = jax.make_jaxpr(rate_after)(jax.ShapeDtypeStruct((), rate.dtype), *shapes)
    return not _depends_on_first_input(closed.jaxpr)


def _depends_on_first_input(jaxpr: Jaxpr) -> bool:
    """Whether the first output of ``jaxpr`` is computed from its first input (an equation
    with a dependent input makes all its outputs dependent)."""
    dependent = {jaxpr.invars[0]}
    for equation in jaxpr.eqns:
        if any(not is_literal(v) and v in dependent for v in equation.invars):
            dependent.update(equation.outvars)
    out = jaxpr.outvars[0]
    return not is_literal(out) and out in dependent


def set_learning_rate(opt_state: PyTree, value: float) -> PyTree:
    """``opt_state`` with every injected ``learning_rate`` set to ``value`` (same dtype and
    shape); raises a ``ValueError`` when the optimizer does not expose one."""
    found = []

    def replace(node):
        if not (_is_injected(node) and "learning_rate" in node.hyperparams):
            return node
        old = node.hyperparams["learning_rate"]
        found.append(old)
        return node._replace(hyperparams={**node.hyperparams, "learning_rate": jnp.asarray(value, old.dtype)})

    new = jax.tree.map(replace, opt_state, is_leaf=_is_injected)
    if not found:
        raise ValueError(_NO_LEARNING_RATE)
    return new


class EmaState(NamedTuple):
    """The wrapped optimizer's state, the moving average of the parameters and the updates
    applied so far."""

    inner_state: PyTree
    ema: PyTree
    count: jax.Array  # type: ignore[assignment]  # the field's name is in saved checkpoints


def with_ema(tx: optax.GradientTransformation, momentum: float = 0.99) -> optax.GradientTransformation:
    """``tx`` that also keeps ``ema = momentum * ema + (1 - momentum) * new_params`` after each
    update (the first update sets ``ema = new_params``), as Keras's ``use_ema=True`` does, in
    its state: sharded like the parameters and checkpointed.
    :class:`trainkit.callbacks.SwapEMAWeights` evaluates with it."""
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"with_ema: momentum must be in [0, 1); received {momentum!r}.")

    def init(params):
        return EmaState(tx.init(params), jax.tree.map(jnp.array, params), jnp.zeros((), jnp.int32))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("with_ema needs the parameters: call tx.update(updates, state, params).")
        updates, inner = tx.update(updates, state.inner_state, params)
        new_params = optax.apply_updates(params, updates)
        rate = jnp.where(state.count > 0, momentum, 0.0)
        ema = jax.tree.map(lambda e, p: (rate * e + (1.0 - rate) * p).astype(e.dtype), state.ema, new_params)
        return updates, EmaState(inner, ema, state.count + 1)

    return optax.GradientTransformation(init, update)


def ema_params(opt_state: PyTree) -> PyTree | None:
    """The moving average of the parameters kept by :func:`with_ema`, or ``None``."""
    for node in jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, EmaState)):
        if isinstance(node, EmaState):
            return node.ema
    return None


def replace_ema(opt_state: PyTree, ema: PyTree) -> PyTree:
    """``opt_state`` with the :func:`with_ema` average replaced by ``ema``."""
    is_ema = lambda n: isinstance(n, EmaState)  # noqa: E731
    return jax.tree.map(lambda n: n._replace(ema=ema) if is_ema(n) else n, opt_state, is_leaf=is_ema)
