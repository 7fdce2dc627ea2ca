"""``DataParallel``: the classic ``jax.pmap`` recipe over a named ``data`` axis.

The state lives as ordinary replicated global arrays passed with ``in_axes=None`` (never
replicated/unreplicated per step); each global batch is split into ``(devices, per_device, ...)``.
Inside the step, gradients and metric sums are summed over ``data`` and batch statistics are
averaged (``lax.pmean``). Every ``pmap`` call of trainkit lives in this file.

>>> import jax
>>> strategy = DataParallel()
>>> strategy.num_batch_shards == len(jax.local_devices()), strategy.axis_name
(True, 'data')
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainkit import distributed
from trainkit.core.leaf_step import Carry, LeafStep, over_carried
from trainkit.core.tree import PyTree
from trainkit.strategies.base import Strategy, make_mesh


class DataParallel(Strategy):
    """Replicated state, batch split across devices, ``jax.pmap`` with ``lax`` collectives.

    Args:
        devices: the devices to use; all local devices by default.
        context, stage: refused: ``jax.pmap`` gives each device whole rows and the whole model, so
            it can split neither a row's sequence nor the model's layers; ``Hybrid(data=..., context=...)``
            and ``Hybrid(data=..., stage=...)`` do.
    """

    axis_name = "data"

    def __init__(
        self, devices: Sequence[jax.Device] | None = None, *, context: int | None = None, stage: int | None = None
    ):
        """``devices`` defaults to every device of every process (the local ones on one)."""
        for name, size, what in (("context", context, "a row's sequence"), ("stage", stage, "the model's layers")):
            if size is not None:
                raise ValueError(
                    f"DataParallel({name}={size!r}): jax.pmap gives every device whole rows and the whole model, "
                    f"so it cannot split {what} over devices. Use tk.Hybrid(data=..., {name}={size!r}) (jax.jit "
                    "with shardings), which does, with the rest of the devices on its data axis."
                )
        self._devices = list(devices) if devices is not None else None
        self._mesh: Mesh | None = None

    @property
    def mesh(self) -> Mesh:
        if self._mesh is None:
            devices = self._devices or jax.devices()
            self._mesh = make_mesh(devices, (len(devices),), (self.axis_name,))
        return self._mesh

    @property
    def num_batch_shards(self) -> int:
        return self.mesh.size

    def put_batch(self, host_batch: PyTree) -> PyTree:
        """This process's rows -> ``(devices, rows_per_device, ...)``, split over ``data``."""
        local = len(self.mesh.local_devices)  # all of them on one process
        return self._put(jax.tree.map(lambda a: np.reshape(a, (local, a.shape[0] // local) + a.shape[1:]), host_batch))

    def abstract_batch(self, host_batch: PyTree) -> PyTree:
        """:meth:`put_batch`'s shapes as ``jax.ShapeDtypeStruct`` (a plan for devices that are not
        here, or from shapes): ``(devices, rows_per_device, ...)``, nothing copied or placed."""
        local = len(self.mesh.local_devices)
        sharding = NamedSharding(self.mesh, PartitionSpec(self.axis_name))

        def split(a: Any) -> jax.ShapeDtypeStruct:
            shape = np.shape(a)
            rows = (shape[0] // local, *shape[1:])
            if jax.process_count() == 1:  # pmap splits host arrays itself: per-device parts, unplaced
                return jax.ShapeDtypeStruct((local, *rows), a.dtype)
            return jax.ShapeDtypeStruct((self.mesh.size, *rows), a.dtype, sharding=sharding)

        return jax.tree.map(split, host_batch)

    def put_batches(self, host_batches: PyTree) -> PyTree:
        """``(k, rows, ...)`` stacked batches -> ``(devices, k, rows_per_device, ...)``."""
        local = len(self.mesh.local_devices)

        def split(a: np.ndarray) -> np.ndarray:
            return np.swapaxes(np.reshape(a, (a.shape[0], local, a.shape[1] // local) + a.shape[2:]), 0, 1)

        return self._put(jax.tree.map(split, host_batches))

    def _put(self, split: PyTree) -> PyTree:
        """Per-device parts ``(local devices, ...)``: as they are on one process (``pmap``
        splits NumPy arguments over its devices itself, cheaper than a ``device_put``
        first); global arrays split over ``data`` on several."""
        sharding = NamedSharding(self.mesh, PartitionSpec(self.axis_name))
        if jax.process_count() == 1:
            return split
        return jax.tree.map(
            lambda part: jax.make_array_from_process_local_data(sharding, part, (self.mesh.size,) + part.shape[1:]),
            split,
        )

    fuses_steps = True

    def compile(self, kind: str, fn: Callable[..., Any], abstract_state: PyTree) -> Callable[..., Any]:
        """``jax.pmap`` over ``data`` with the state and the totals as replicated arguments
        (``in_axes=None``): training steps donate the state and return both replicated; eval
        returns the totals (reduced, the same on every device); predict outputs stay per
        device, one row per example."""
        trains = kind in ("train", "train_steps")
        out_axes = (None, None) if trains else None if kind == "eval" else 0
        leaves, treedef = jax.tree.flatten(abstract_state)
        carry = Carry(leaves, [True] * len(leaves))  # pmap's state is whole on every device
        compiled = jax.pmap(
            over_carried(fn, treedef, carry) if trains else fn,  # a training step over the state's leaves (LeafStep)
            axis_name=self.axis_name,
            in_axes=(None, 0) if kind == "predict" else (None, None, 0),  # (state, [totals,] batch)
            out_axes=out_axes,
            devices=self.devices,
            donate_argnums=(0,) if trains else (),
        )
        return LeafStep(compiled, treedef, carry, self.put_replicated) if trains else compiled

    def fetch_rows(self, tree: PyTree) -> PyTree:
        if jax.process_count() > 1:  # pmap's per-device outputs come back as this process's part
            from jax.experimental import multihost_utils

            tree = jax.tree.map(
                lambda a: (
                    multihost_utils.process_allgather(np.asarray(a), tiled=True)
                    if not isinstance(a, jax.Array) or a.is_fully_addressable
                    else a
                ),
                tree,
            )
        host = distributed.fetch(tree)
        return jax.tree.map(lambda a: np.asarray(a).reshape((-1,) + a.shape[2:]), host)

    def describe(self) -> str:
        return f"DataParallel(pmap over {self.mesh.size} devices, axis 'data')"
