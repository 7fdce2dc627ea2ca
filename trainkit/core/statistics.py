"""Statistics computed inside the train step: norms of the gradients, the parameters and the
updates, and the update/parameter ratio, globally and per module, on the steps that log them.

They ride in the epoch's device totals as one :class:`DueValue` metric, a vector in the order
of :meth:`StepStatistics.names` (hidden: its name starts with ``_``), so nothing reaches the
host until a callback reads them (``tk.callbacks.GradientStats`` on the steps it logs). Under
every strategy they are the norms of the global arrays: the gradients after the all-reduce, the
parameters however they are sharded.

>>> import jax.numpy as jnp
>>> spec = StepStatistics(every=2, per_layer="dense")
>>> grads = {"dense": {"kernel": jnp.full((2, 2), 0.5)}, "head": {"bias": jnp.ones(3)}}
>>> params = {"dense": {"kernel": jnp.ones((2, 2))}, "head": {"bias": jnp.zeros(3)}}
>>> stats = spec.metrics(jnp.int32(4), grads, grads, params)["_stats/values"].compute()
>>> measured = dict(zip(spec.names(params), stats.tolist()))
>>> measured["grad_norm/dense"], measured["update_ratio/dense"]
(1.0, 0.5)
>>> sorted(measured) == sorted(f"{n}{s}" for n in KINDS for s in ("", "/dense"))
True
"""

from __future__ import annotations

import dataclasses
import re

import clu.metrics
import flax.struct
import jax
import jax.numpy as jnp

from trainkit.core.tree import PyTree, leaf_name

#: what is measured, each globally and per matching module
KINDS = ("grad_norm", "param_norm", "update_norm", "update_ratio")
#: the prefix of their (hidden) metric names in the step's totals
PREFIX = "_stats/"
#: when a compiled train step measures (:meth:`StepStatistics.metrics`)
WHEN = ("due", "always", "never")


@flax.struct.dataclass
class DueValue(clu.metrics.Metric):
    """A value measured on some steps only: a merge keeps the latest step that measured it
    (``due`` > 0). ``compute()`` is that value (NaN when no step measured it)."""

    value: jax.Array
    due: jax.Array

    def merge(self, other: DueValue) -> DueValue:
        keep = other.due > 0
        return DueValue(jnp.where(keep, other.value, self.value), jnp.maximum(self.due, other.due))

    def compute(self) -> jax.Array:
        return jnp.where(self.due > 0, self.value, jnp.nan)


def module_of(name: str) -> str:
    """The module path of a parameter's name (``"encoder/Dense_0/kernel"`` -> ``"encoder/Dense_0"``)."""
    return name.rsplit("/", 1)[0] if "/" in name else name


@dataclasses.dataclass(frozen=True)
class StepStatistics:
    """What the train step measures: every ``every`` optimizer steps (step numbers from 1), the
    global norms and, for each module whose path matches the regex ``per_layer`` (``re.search``;
    ``None``: none), the module's own."""

    every: int = 100
    per_layer: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every must be a positive number of steps; received {self.every!r}.")
        if self.per_layer is not None:
            try:
                re.compile(self.per_layer)
            except re.error as error:
                raise ValueError(f"per_layer={self.per_layer!r} is not a regular expression: {error}.") from error

    def modules(self, params: PyTree) -> dict[str, list[int]]:
        """The reported modules, each with the indices of its leaves in ``params``' leaves."""
        if self.per_layer is None:
            return {}
        groups: dict[str, list[int]] = {}
        pattern = re.compile(self.per_layer)
        for index, (path, _) in enumerate(jax.tree_util.tree_leaves_with_path(params)):
            module = module_of(leaf_name(path))
            if pattern.search(module):
                groups.setdefault(module, []).append(index)
        return groups

    def names(self, params: PyTree) -> list[str]:
        """The statistics' names, in the order of :meth:`measured` (and of the vector the step
        keeps): each kind globally, then each kind per reported module."""
        suffixes = ["", *(f"/{module}" for module in self.modules(params))]
        return [f"{kind}{suffix}" for suffix in suffixes for kind in KINDS]

    def measured(self, grads: PyTree, updates: PyTree, params: PyTree) -> dict[str, jax.Array]:
        """Every statistic of one step, by name (``grad_norm``, ``grad_norm/<module>``, ...)."""
        triples = zip(jax.tree.leaves(grads), jax.tree.leaves(updates), jax.tree.leaves(params), strict=True)
        sums = [_squares(*triple) for triple in triples]
        squares = {kind: [s[row] for s in sums] for row, kind in enumerate(("grad", "update", "param"))}
        out: dict[str, jax.Array] = {}
        for suffix, indices in {"": None, **{f"/{m}": i for m, i in self.modules(params).items()}}.items():
            norms = {
                kind: jnp.sqrt(sum(values if indices is None else [values[i] for i in indices], jnp.float32(0)))
                for kind, values in squares.items()
            }
            out[f"grad_norm{suffix}"] = norms["grad"]
            out[f"param_norm{suffix}"] = norms["param"]
            out[f"update_norm{suffix}"] = norms["update"]
            out[f"update_ratio{suffix}"] = norms["update"] / jnp.maximum(norms["param"], jnp.finfo(jnp.float32).tiny)
        return out

    def metrics(
        self, step: jax.Array, grads: PyTree, updates: PyTree, params: PyTree, when: str = "due"
    ) -> dict[str, DueValue]:
        """The step's statistics as one :class:`DueValue` (``PREFIX + "values"``: a vector in the
        order of :meth:`names`), due when ``step`` is a multiple of ``every``. ``when`` (one of
        :data:`WHEN`) is what the compiled step does: ``"due"`` measures on due steps only (a
        ``lax.cond``: the other steps compute nothing; steps fused into one call), ``"always"``
        measures (the variant the loop calls on due steps), ``"never"`` reports nothing (the
        variant it calls on the others: no branch, nothing computed or merged; the totals keep
        the last measurement). One vector, not a
        metric per statistic: on a dispatch-bound step each scalar the step carries costs XLA
        its own small kernels (24 scalars: +90 us a step on a CPU)."""
        if when not in WHEN:
            raise ValueError(f"when={when!r}: one of {WHEN}.")
        if when == "never":  # nothing reported: the epoch's totals keep the last measurement as it is
            return {}
        count = len(self.names(params))
        due = (step % self.every) == 0

        def measure(operands: tuple[jax.Array, ...]) -> jax.Array:
            return jnp.stack(list(self.measured(*operands).values()))

        operands = (grads, updates, params)
        if when == "always":
            values = measure(operands)
        else:
            values = jax.lax.cond(due, measure, lambda _: jnp.zeros((count,), jnp.float32), operands)
        return {PREFIX + "values": DueValue(values, due.astype(jnp.float32))}


#: leaves of at most this many elements have their three sums of squares taken in one reduction
#: (a small leaf's three reductions cost three kernels: on a dispatch-bound step that cost a
#: measuring step 3x a plain one); XLA:CPU copies the stack, so a larger leaf is reduced in place
STACKED_SQUARES = 2**16


def _squares(grad: jax.Array, update: jax.Array, param: jax.Array) -> jax.Array:
    """The sums of squares of one leaf's gradient, update and parameter (float32)."""
    if grad.size <= STACKED_SQUARES:  # the stack keeps the leaf's sharding
        stacked = jnp.stack([grad, update, param]).astype(jnp.float32)
        return jnp.sum(jnp.square(stacked), axis=tuple(range(1, stacked.ndim)))
    return jnp.stack([jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in (grad, update, param)])
