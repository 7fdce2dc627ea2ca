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

import math
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


#: the equations counted as a model's matrix multiplies (a convolution is one, over its windows)
MATMULS = ("dot_general", "conv_general_dilated")


def _shape(atom: Atom) -> tuple[int, ...]:
    aval = atom.aval
    assert isinstance(aval, jax.core.ShapedArray), aval  # an array operand of a matmul
    return tuple(int(size) for size in aval.shape)


def _multiply_add_flops(eqn: JaxprEqn) -> float:
    """Two flops per multiply-add of a ``dot_general`` (its output's size times the contracted
    size) or a ``conv_general_dilated`` (its output's size times one kernel window's inputs)."""
    output = math.prod(_shape(eqn.outvars[0]))
    if eqn.primitive.name == "dot_general":
        (contracting, _), _ = eqn.params["dimension_numbers"]
        lhs = _shape(eqn.invars[0])
        contracted: int = math.prod(lhs[int(d)] for d in contracting)
        return 2.0 * output * contracted
    kernel = _shape(eqn.invars[1])
    out_features: int = kernel[int(eqn.params["dimension_numbers"].rhs_spec[0])]
    return 2.0 * output * math.prod(kernel) / out_features


def _inner_jaxprs(eqn: JaxprEqn) -> list[Jaxpr]:
    """The programs an equation runs (a ``jit``'s body, ``cond``'s branches, ``scan``'s step ...)."""
    found: list[Jaxpr] = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, _core.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, _core.Jaxpr):
                found.append(item)
    return found


def matmul_flops(jaxpr: Jaxpr, halved_scope: str, *, inside: bool = False) -> float:
    """The flops of ``jaxpr``'s matrix multiplies (:data:`MATMULS`) as the shapes say, whatever
    runs them: inner programs counted where they run (a ``scan``'s step times its length, a Pallas
    kernel's block times its grid, the largest of ``cond``'s branches, a ``while``'s body once), those traced inside a
    ``jax.named_scope(halved_scope)`` counted half (causal attention: half its scores are needed).

    >>> import jax, jax.numpy as jnp
    >>> closed = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((4, 8)), jnp.ones((8, 2)))
    >>> matmul_flops(closed.jaxpr, "halved")
    128.0
    """
    total = 0.0
    for eqn in jaxpr.eqns:
        here = inside or halved_scope in str(eqn.source_info.name_stack)
        if eqn.primitive.name in MATMULS:
            total += _multiply_add_flops(eqn) * (0.5 if here else 1.0)
            continue
        inner = [matmul_flops(program, halved_scope, inside=here) for program in _inner_jaxprs(eqn)]
        if inner:
            total += max(inner) if eqn.primitive.name == "cond" else _runs(eqn) * sum(inner)
    return total


def _runs(eqn: JaxprEqn) -> int:
    """How many times an equation runs its inner program: a ``scan``'s length, a Pallas kernel's
    grid (its body is one block's), else once."""
    if eqn.primitive.name == "scan":
        return int(eqn.params["length"])
    if eqn.primitive.name == "pallas_call":
        return math.prod(int(size) for size in eqn.params["grid_mapping"].grid)
    return 1
