"""A traced program's equations, through ``jax.extend.core`` only here.

>>> import jax, jax.numpy as jnp
>>> closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0)(1.0)
>>> [eqn.primitive.name for eqn in closed.jaxpr.eqns]
['sin', 'mul']
>>> run = function_of(closed.jaxpr.eqns, closed.jaxpr.invars, closed.jaxpr.outvars, "example")
>>> float(run(0.0)[0])
0.0
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeAlias, cast

import jax
from jax.extend import core as _core
from typing_extensions import TypeIs

Var: TypeAlias = _core.Var
Literal: TypeAlias = _core.Literal
Jaxpr: TypeAlias = _core.Jaxpr
JaxprEqn: TypeAlias = _core.JaxprEqn
ClosedJaxpr: TypeAlias = _core.ClosedJaxpr
#: an equation's operand: a variable, or a constant written into the program
Atom: TypeAlias = Var | Literal


def is_var(atom: Atom) -> TypeIs[Var]:
    """Whether ``atom`` is a variable (not a literal constant)."""
    return isinstance(atom, _core.Var)


def is_literal(atom: object) -> TypeIs[Literal]:
    """Whether ``atom`` is a literal constant written into the program."""
    return isinstance(atom, _core.Literal)


def as_function(closed: ClosedJaxpr) -> Callable[..., list[jax.Array]]:
    """``closed`` as a function of its inputs (a list of its outputs), to trace again or vmap."""
    return cast(Callable[..., list[jax.Array]], _core.jaxpr_as_fun(closed))


def function_of(
    eqns: Sequence[JaxprEqn], inputs: Sequence[Var], outputs: Sequence[Var], name: str
) -> Callable[..., list[jax.Array]]:
    """The equations ``eqns`` (in order) as a function of ``inputs`` giving ``outputs``."""
    effects = frozenset().union(*(eqn.effects for eqn in eqns))
    info = _core.DebugInfo(name, f"trainkit {name}", None, ("",) * len(outputs))
    jaxpr = _core.Jaxpr([], list(inputs), list(outputs), list(eqns), effects, info)
    return as_function(_core.ClosedJaxpr(jaxpr, []))


def scan_counts(eqn: JaxprEqn) -> tuple[int, int]:
    """How many of a ``scan`` equation's operands are its constants and its carry (the rest are its
    stacked inputs). jax 0.10 names the counts; jax 0.12 groups the operands in a flat tree ``ft_in``."""
    if "ft_in" in eqn.params:
        consts, carry, _ = eqn.params["ft_in"].unpack()
        return len(consts), len(carry)
    return eqn.params["num_consts"], eqn.params["num_carry"]


def scan_body(eqn: JaxprEqn) -> Callable[..., list[jax.Array]]:
    """A ``scan`` equation's body (one step: constants, carry and one slice of the stacked inputs)."""
    return as_function(eqn.params["jaxpr"])


def called_jaxpr(eqn: JaxprEqn) -> Jaxpr | None:
    """The body of a plain call (a ``jit`` inside the traced function) whose inputs are the call's own;
    ``None`` for any other equation."""
    inner = eqn.params.get("jaxpr")
    if isinstance(inner, _core.ClosedJaxpr):
        inner = inner.jaxpr
    if isinstance(inner, _core.Jaxpr) and len(inner.invars) == len(eqn.invars) and not inner.constvars:
        return inner
    return None
