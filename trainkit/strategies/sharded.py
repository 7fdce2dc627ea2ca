"""Strategies compiled with ``jax.jit`` and ``NamedSharding``: the base and ``SingleDevice``.

The compiler inserts the collectives from the shardings (``axis_name`` is ``None``): the step
is the single-device step, so batch statistics span the global batch and random masks do not
depend on the sharding (``jax_threefry_partitionable``). ``FSDP`` and ``Hybrid`` only choose
a mesh and a ``PartitionSpec`` per leaf.

>>> strategy = SingleDevice()
>>> strategy.num_batch_shards, strategy.axis_name
(1, None)
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainkit import distributed
from trainkit.attn import ContextSplit
from trainkit.attn.reach import ReachAttention
from trainkit.core.leaf_step import LeafStep
from trainkit.core.state import TrainState
from trainkit.core.step import full_mask
from trainkit.core.tree import KeyPath, PyTree, TreeFunction, leaf_name
from trainkit.strategies import _sharding
from trainkit.strategies.base import GATHERING_SPLIT_BATCH, Strategy, make_mesh
from trainkit.strategies.gpipe import Schedule


class ShardedStrategy(Strategy):
    """A mesh, a ``PartitionSpec`` per state leaf, the batch split over ``batch_axes``.

    Subclasses set ``axis_sizes`` (an ordered ``{axis name: size}``), ``batch_axes``,
    ``fsdp_axis`` (the axis the default rule shards large leaves over, or ``None``), ``rules``
    and ``min_shard_size``; this class builds the mesh and compiles the steps with ``jax.jit``.
    """

    axis_name = None
    batch_axes: tuple[str, ...] = ()
    fsdp_axis: str | None = None
    min_shard_size: int = 2**10

    def __init__(
        self,
        axis_sizes: dict[str, int | None],
        *,
        devices: Sequence[jax.Device] | None = None,
        rules: Sequence[Any] = (),
        min_shard_size: int = 2**10,
    ):
        self._axis_sizes = dict(axis_sizes)
        self._given_devices = list(devices) if devices is not None else None
        if not isinstance(min_shard_size, (int, np.integer)) or min_shard_size < 1:
            raise ValueError(f"min_shard_size must be a positive integer; received {min_shard_size!r}.")
        self.min_shard_size = int(min_shard_size)
        self.rules = list(rules)
        self._rules, logical = _sharding.split_rules(self.rules, tuple(self._axis_sizes))
        self.logical_rules = tuple(logical)
        self.param_axes: dict[str, tuple[Any, ...]] = {}  # the model's annotations (see with_annotations)
        self._mesh: Mesh | None = None

    # ------------------------------------------------------------------ mesh
    def _default_devices(self) -> list[jax.Device]:
        return jax.devices()

    @property
    def mesh(self) -> Mesh:
        if self._mesh is None:
            devices = self._given_devices or self._default_devices()
            sizes = self._resolve_sizes(len(devices))
            self._mesh = make_mesh(devices, tuple(sizes.values()), tuple(sizes))
        return self._mesh

    def _resolve_sizes(self, count: int) -> dict[str, int]:
        """Fills in one ``None`` axis size from the device count; checks the product."""
        known = math.prod(v for v in self._axis_sizes.values() if v is not None)
        given = {k: v for k, v in self._axis_sizes.items() if v is not None}
        missing = [k for k, v in self._axis_sizes.items() if v is None]
        if missing and count % known:
            raise ValueError(
                f"{type(self).__name__}: the given axis sizes {given} (product {known}) do "
                f"not divide the {count} devices; choose sizes whose product divides {count}."
            )
        sizes = {k: count // known if v is None else v for k, v in self._axis_sizes.items()}
        product = math.prod(sizes.values())
        if product != count:
            raise ValueError(
                f"{type(self).__name__}: the mesh axes {sizes} hold {product} devices, but "
                f"{count} devices are in use. Choose axis sizes whose product is {count}, or "
                "pass devices=... with that many devices."
            )
        return sizes

    @property
    def num_batch_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    @functools.cached_property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(self.batch_axes) if self.batch_axes else PartitionSpec())

    # ------------------------------------------------------------------ state
    def with_annotations(self, param_axes: dict[str, tuple[Any, ...]]) -> ShardedStrategy:
        """A copy placing the model's annotated parameters (Flax's
        ``nn.with_logical_partitioning`` / ``nn.with_partitioning`` names), and the optimizer
        moments of those, by its logical rules; this strategy is left as it is. Without
        logical rules the annotations are not used and it returns itself."""
        if not self.logical_rules:
            return self
        annotated = copy.copy(self)
        annotated.param_axes = dict(param_axes)
        return annotated

    def annotation_specs(self) -> dict[str, PartitionSpec]:
        """``{parameter path: PartitionSpec}`` of the annotated parameters under the logical
        rules (empty without logical rules: annotations are then not used)."""
        if not self.logical_rules:
            return {}
        axis_names = tuple(self._axis_sizes)
        return {
            path: _sharding.logical_spec(names, self.logical_rules, axis_names, f"params/{path}")
            for path, names in self.param_axes.items()
        }

    @property
    def schedule(self) -> Schedule | None:
        """The pipeline's schedule over ``stage_axis`` (``None``: no pipeline)."""
        if self.stage_axis is None:
            return None
        return Schedule(self.mesh, self.stage_axis, self.microbatches, self.batch_axes)

    def state_specs(self, abstract_state: PyTree) -> PyTree:
        """A ``PartitionSpec`` per leaf (errors name the leaf and the rule); a pipeline's stacked
        parameters (and their optimizer moments) split over ``stage_axis`` along their layer axis,
        and inside a stage as FSDP splits any leaf."""
        specs = _sharding.partition_specs(
            abstract_state,
            dict(self.mesh.shape),
            fsdp_axis=self.fsdp_axis,
            min_shard_size=self.min_shard_size,
            rules=self._rules,
            annotations=self.annotation_specs(),
        )
        if not self.stage_paths:
            return specs
        stacked = {path: PartitionSpec(self.stage_axis) for path in self.stage_paths}
        fsdp_size = self.mesh.shape[self.fsdp_axis] if self.fsdp_axis else 1

        def staged(path: KeyPath, leaf: jax.ShapeDtypeStruct, spec: PartitionSpec) -> PartitionSpec:
            name, shape = leaf_name(path), tuple(np.shape(leaf))
            if _sharding.annotated_spec(name, shape, stacked) is None:
                return spec
            ruled = _sharding.leaf_spec(  # a rule's or annotation's own (tensor parallelism inside a stage)
                name,
                shape,
                dict(self.mesh.shape),
                fsdp_axis=None,
                min_shard_size=self.min_shard_size,
                rules=self._rules,
                annotations=self.annotation_specs(),
            )
            if any(entry is not None for entry in ruled):
                if ruled[0] is not None:
                    shifted = PartitionSpec(None, *tuple(ruled)[: len(shape) - 1])
                    raise ValueError(
                        f"{self!r}: a rule places {name} {shape} as {ruled}, splitting its first axis, the stacked "
                        f"blocks' layer axis, which the stage axis splits. Write the rule for the stacked shape "
                        f"(layers first), with None there: {shifted}."
                    )
                return PartitionSpec(self.stage_axis, *ruled[1:])
            inner = _sharding.default_spec(shape[1:], self.fsdp_axis, fsdp_size, self.min_shard_size)
            return PartitionSpec(self.stage_axis, *inner)

        restaged: PyTree = jax.tree_util.tree_map_with_path(staged, abstract_state, specs)
        return restaged

    def state_sharding(self, abstract_state: PyTree) -> PyTree:
        """A ``NamedSharding`` per leaf; under :meth:`with_offload` the optimizer state's
        :func:`~trainkit.core.offload.on_host` leaves in ``pinned_host`` memory, and the
        parameters it names frozen (``offload="optimizer+frozen"``)."""
        is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
        shardings = jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), self.state_specs(abstract_state), is_leaf=is_spec
        )
        if not self.offload.optimizer or not isinstance(abstract_state, TrainState):
            return shardings
        opt_state = _sharding.in_host_memory(shardings.opt_state, abstract_state.opt_state)
        params = _sharding.paths_in_host_memory(shardings.params, self.offload.frozen_paths)
        return shardings.replace(opt_state=opt_state, params=params)

    # ------------------------------------------------------------------ batches and steps
    @functools.cached_property
    def stacked_batch_sharding(self) -> NamedSharding:
        """Batches stacked on a leading (step) axis: each split as one batch is."""
        return NamedSharding(self.mesh, PartitionSpec(None, *self.batch_sharding.spec))

    def batch_share(self) -> tuple[int, int]:
        """From the batch's sharding: the rows this process's devices hold, as an equal part of
        the batch; processes whose devices hold the same rows (an axis besides the batch's that
        spans processes: a stage, model or context axis across hosts) read the same part."""
        return self._batch_share

    @functools.cached_property
    def _batch_share(self) -> tuple[int, int]:  # read with every batch placed on several processes
        count = jax.process_count()
        if count == 1:
            return 0, 1
        rows = self.num_batch_shards * count  # a batch the sharding splits evenly, whatever the share
        held: dict[int, set[tuple[int, int]]] = {}
        indices = self.batch_sharding.devices_indices_map((rows,))
        for device in self.mesh.devices.flat:
            held.setdefault(int(device.process_index), set()).add(indices[device][0].indices(rows)[:2])
        spans = {process: (min(s for s, _ in got), max(e for _, e in got)) for process, got in held.items()}
        parts = sorted(set(spans.values()))
        size = rows // len(parts)
        if any(end - start != size or start % size for start, end in parts) or len(parts) * size != rows:
            raise ValueError(
                f"{self!r}: its batch sharding gives the processes' devices rows {sorted(spans.items())} of {rows}, "
                "not equal parts of the batch in process order; order the mesh's devices so that each process "
                "holds a contiguous part (the data axes across the processes, or another axis across them whole)."
            )
        return spans[jax.process_index()][0] // size, len(parts)

    def _put(self, host_batch: PyTree, sharding: NamedSharding) -> PyTree:
        """On one process the NumPy batch itself: the compiled call places it by its input
        shardings, in C++, about five times faster than a ``jax.device_put`` first (which
        matters when a step is shorter than its dispatch). Several processes: each passes its
        rows of the global array (its :meth:`batch_share`)."""
        if jax.process_count() > 1:
            count = self.batch_share()[1]
            lead = 1 if sharding.spec and sharding.spec[0] is None else 0  # stacked batches: rows second

            def put(a: np.ndarray) -> jax.Array:
                shape = (*a.shape[:lead], a.shape[lead] * count, *a.shape[lead + 1 :])
                placed: jax.Array = jax.make_array_from_process_local_data(sharding, a, shape)
                return placed

            return jax.tree.map(put, host_batch)
        return host_batch

    def put_batch(self, host_batch: PyTree) -> PyTree:
        mask = host_batch.get("mask") if isinstance(host_batch, dict) else None
        if isinstance(mask, np.ndarray) and jax.process_count() == 1:
            return {**host_batch, "mask": self._placed_mask(mask)}
        return self._put(host_batch, self.batch_sharding)

    def abstract_batch(self, host_batch: PyTree) -> PyTree:
        """Each leaf as a ``jax.ShapeDtypeStruct`` in the batch sharding: nothing placed."""
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=self.batch_sharding), host_batch
        )

    def _placed_mask(self, mask: np.ndarray) -> jax.Array:
        """A batch's mask on the devices; a full batch's (the shared ``full_mask``) placed once.
        Sending it with every step cost a dispatch-bound step (MLP 32-64-10, batch 32, one CPU
        device) about 6 us of its 60. Every mask is placed, the padded ones too: JAX compiles a
        step again for an argument that arrives placed instead of as NumPy."""
        if mask is not full_mask(len(mask)):
            placed: jax.Array = jax.device_put(mask, self.batch_sharding)
            return placed
        if len(mask) not in self._full_masks:
            self._full_masks[len(mask)] = jax.device_put(mask, self.batch_sharding)
        return self._full_masks[len(mask)]

    @functools.cached_property
    def _full_masks(self) -> dict[int, jax.Array]:
        """The placed full-batch masks, by rows."""
        return {}

    def put_batches(self, host_batches: PyTree) -> PyTree:
        return self._put(host_batches, self.stacked_batch_sharding)

    fuses_steps = True
    offloads = True

    gathers_on_device = True  # but under a context axis or a pipeline (refused where it is asked for)

    def compile(self, kind: str, fn: TreeFunction, abstract_state: PyTree) -> TreeFunction:
        """``jax.jit`` with the state's shardings pinned: training steps donate the state and
        carry the replicated totals; eval carries them too; predict keeps the rows split as
        the batch is."""
        state, totals = self.state_sharding(abstract_state), self.replicated()
        batch: PyTree = self.stacked_batch_sharding if kind == "train_steps" else self.batch_sharding
        if kind == "train_steps_gathered":  # the rows of data kept whole on every device
            if self.context_axis is not None or self.schedule is not None:
                raise NotImplementedError(f"{self!r}: {GATHERING_SPLIT_BATCH}. Pass fit(..., data_on_device=False).")
            stacked = self.stacked_batch_sharding
            batch = {"table": self.replicated(), "rows": stacked, "mask": stacked}
        fn = self._sequences_split(fn, kind)
        if kind in ("train", "train_steps", "train_steps_gathered"):  # over the state's leaves (LeafStep)
            ins, outs = (state, totals, batch), (state, totals)
            return LeafStep.jit(fn, abstract_state, in_shardings=ins, out_shardings=outs, replicated=totals)
        if kind == "eval":
            return jax.jit(fn, in_shardings=(state, totals, batch), out_shardings=totals)
        return jax.jit(fn, in_shardings=(state, batch), out_shardings=self.batch_sharding)

    def trace_parts(self) -> tuple[object, ...]:
        """The pipeline's schedule, the logical axis rules on its mesh, and under a context axis the
        split ``tk.attention`` makes by hand (with ``reach_attention``: also Flax's and JAX's own)."""
        parts: list[object | None] = [self.schedule]
        if self.logical_rules:
            parts.append(_sharding.LogicalRules(self.mesh, self.logical_rules))
        if self.context_axis is not None:
            parts.append(ContextSplit(self.mesh, self.context_axis, self.batch_axes))
            parts.append(ReachAttention() if self.reach_attention else None)
        return tuple(part for part in parts if part is not None)

    def _sequences_split(self, fn: TreeFunction, kind: str) -> TreeFunction:
        """``fn`` with its batch's sequences split over the context axis (``sequence_axis`` of each
        batch array long enough, a multiple of the axis): a layout constraint, so the numbers are
        the same; every activation along the sequence follows it, and the compiler gathers what a
        layer needs whole (attention's keys and values). ``fn`` itself without a context axis."""
        if self.context_axis is None:
            return fn
        where, lead = (1, ()) if kind == "predict" else (2, (None,) if kind == "train_steps" else ())
        axis, size = self.sequence_axis + len(lead), self.mesh.shape[self.context_axis]
        rows = self.batch_axes or None
        spec = PartitionSpec(*lead, rows, *[None] * (self.sequence_axis - 1), self.context_axis)

        def split(path: KeyPath, leaf: jax.Array) -> jax.Array:  # traced
            if leaf.ndim <= axis or leaf.shape[axis] < size:  # rows alone (a mask), or features shorter than the axis
                return leaf
            if leaf.shape[axis] % size:
                raise ValueError(
                    f"{self!r}: the batch's {leaf_name(path) or 'array'} has {leaf.shape[axis]} positions along "
                    f"sequence_axis={self.sequence_axis}, which do not split evenly over the {size} devices of the "
                    f"context axis. Pad the sequences to a multiple of {size}, or choose a context size that divides "
                    f"{leaf.shape[axis]}."
                )
            constrained: jax.Array = jax.lax.with_sharding_constraint(leaf, NamedSharding(self.mesh, spec))
            return constrained

        @functools.wraps(fn)
        def split_step(*args: PyTree) -> PyTree:  # attention's split by hand: a part of the trace context
            return fn(*args[:where], jax.tree_util.tree_map_with_path(split, args[where]), *args[where + 1 :])

        return split_step

    def fetch_rows(self, tree: PyTree) -> PyTree:
        return jax.tree.map(np.asarray, distributed.fetch(tree))

    def describe(self) -> str:
        axes = ", ".join(f"{k}={v}" for k, v in self.mesh.shape.items())
        return f"{type(self).__name__}(jit over {self.mesh.size} devices, mesh {axes})"


class SingleDevice(ShardedStrategy):
    """Everything on one device, compiled with ``jax.jit`` (the state donated).

    Args:
        device: the device to use; the first local device by default.
    """

    def __init__(self, device: jax.Device | None = None):
        super().__init__({"data": 1}, devices=None if device is None else [device])

    def _default_devices(self) -> list[jax.Device]:
        return list(jax.local_devices()[:1])

    def describe(self) -> str:
        return f"SingleDevice({self.devices[0]})"

    def __repr__(self) -> str:
        return self.describe()
