"""The GPipe schedule over a mesh axis, SPMD under ``jax.jit``: every stage's state is one row
of arrays that lead with the stage count and are sharded over the ``stage`` axis, each tick
runs every stage's layers at once (``jax.vmap`` over that leading axis, so each device computes
its own stage), and a shift of the states by one passes each stage's output to the next (the
compiler's collective permute). No ``shard_map``: the layer, traced outside, keeps whatever
shardings it has (FSDP or tensor-parallel parameters inside a stage).

Stage ``s`` holds its ``L/S`` consecutive layers and, at tick ``t`` of ``M + S - 1``, runs them
on microbatch ``t - s``: stage 0 reads it from the inputs, every other stage receives it from
the stage before; the last stage's results from tick ``S - 1`` on are the microbatches'
outputs. Ticks outside a stage's microbatches (the bubble) compute on real rows, never on
zeros, so no division by zero puts a NaN in a gradient, and their results are dropped.

>>> import jax, jax.numpy as jnp, numpy as np
>>> from jax.sharding import Mesh
>>> mesh = Mesh(np.array(jax.devices()[:1]), ("stage",))
>>> layer = Layer(lambda consts, h, xs: [h[0] * xs[0]], per_micro=[])
>>> out = gpipe(layer, [], [jnp.ones((2, 3))], [jnp.full((4,), 2.0)], Schedule(mesh, "stage", 2))
>>> out[0].tolist()  # four layers, each doubling
[[16.0, 16.0, 16.0], [16.0, 16.0, 16.0]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Arrays = list[jax.Array]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A GPipe schedule: ``microbatches`` through the stages of the ``axis`` of ``mesh``; each
    microbatch's rows stay split over ``batch_axes`` (the data axes) inside a stage."""

    mesh: Mesh
    axis: str
    microbatches: int
    batch_axes: tuple[str, ...] = ()

    @property
    def stages(self) -> int:
        return int(self.mesh.shape[self.axis])


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer: ``fn(consts, carry, xs) -> carry`` (lists of arrays; ``xs`` one layer's slice of
    the stacked operands); ``per_micro[i]``: whether ``consts[i]`` leads with the microbatches,
    ``stacked_per_micro[i]``: whether the stacked ``xs[i]`` does (``(M, L, ...)``: a random key
    per microbatch and layer) rather than being the same for all (``(L, ...)``: parameters)."""

    fn: Callable[[Arrays, Arrays, Arrays], Arrays]
    per_micro: Sequence[bool]
    stacked_per_micro: Sequence[bool] = ()


def gpipe(layer: Layer, consts: Arrays, carry: Arrays, stacked: Arrays, schedule: Schedule) -> Arrays:
    """The carry ``(M, ...)`` (one entry per microbatch) after every layer of ``stacked`` (each
    ``(L, ...)``, or ``(M, L, ...)``: see :class:`Layer`), the layers split over ``schedule``'s stages."""
    stages, m = schedule.stages, schedule.microbatches
    free = PartitionSpec.UNCONSTRAINED

    def per_stage(a: jax.Array, rows: bool = True) -> jax.Array:
        """``a`` with its leading (stage) axis split over the stages, and its rows (the next axis,
        for activations) over the data axes; the rest as the compiler places it."""
        lead = (schedule.axis, schedule.batch_axes or None) if rows else (schedule.axis,)
        spec = PartitionSpec(*lead, *[free] * (a.ndim - len(lead)))
        constrained: jax.Array = jax.lax.with_sharding_constraint(a, NamedSharding(schedule.mesh, spec))
        return constrained

    per_micro_stacked = list(layer.stacked_per_micro) or [False] * len(stacked)
    # (L, ...) -> (S, L/S, ...): stage s holds layers s*L/S .. (s+1)*L/S - 1; per-microbatch ones (S, M, L/S, ...)
    local = [
        per_stage(jnp.moveaxis(x.reshape(m, stages, -1, *x.shape[2:]), 1, 0), rows=False)
        if per
        else per_stage(x.reshape(stages, -1, *x.shape[1:]), rows=False)
        for x, per in zip(stacked, per_micro_stacked)
    ]
    stage_index = jnp.arange(stages)

    def layers(consts_s: Arrays, h: Arrays, local_s: Arrays) -> Arrays:  # one stage, its microbatch
        return jax.lax.scan(lambda h, xs: (layer.fn(consts_s, h, xs), None), h, local_s)[0]

    def tick(received: Arrays, t: jax.Array) -> tuple[Arrays, Arrays]:
        micro = jnp.clip(t - stage_index, 0, m - 1)  # each stage's microbatch (clipped in the bubble)
        h = [per_stage(r.at[0].set(x[micro[0]])) for x, r in zip(carry, received)]
        consts_s = [c[micro] if per else c for c, per in zip(consts, layer.per_micro)]
        local_s = [x[stage_index, micro] if per else x for x, per in zip(local, per_micro_stacked)]
        in_axes = ([0 if per else None for per in layer.per_micro], 0, 0)
        out = [per_stage(y) for y in jax.vmap(layers, in_axes=in_axes)(consts_s, h, local_s)]
        # stage s+1 receives stage s's output (stage 0 keeps its own, which it replaces: no wrap-around send)
        passed = [jnp.concatenate([y[:1], y[:-1]]) for y in out]
        return passed, out  # every stage's output, left where it is: only the last stage's are read

    start = [per_stage(jnp.broadcast_to(x[0], (stages, *x.shape[1:]))) for x in carry]
    _, outs = jax.lax.scan(tick, start, jnp.arange(m + stages - 1))
    # microbatch t - (S-1) finished at tick t. (Dealing them out over the stages, so that each runs the
    # head on M/S of them, sent 10% less across two TPU slices, but made XLA's CPU runtime issue its
    # collectives in different orders on different devices: a deadlock.)
    return [y[stages - 1 :, stages - 1] for y in outs]
