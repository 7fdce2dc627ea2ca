"""``FSDP``: parameters and optimizer state sharded over an ``fsdp`` mesh axis (ZeRO-3 style).

Each large leaf is split along its largest dimension that the device count divides; leaves
under ``min_shard_size`` elements stay replicated; ``rules`` override by regex on the leaf's
path. The batch is split over all devices. ``jax.jit`` gathers each parameter where it is used
and reduce-scatters its gradient, so every device holds about 1/N of the state.

>>> from jax.sharding import PartitionSpec as P
>>> strategy = FSDP(rules=[(r"Embed_0/embedding", P(None, "fsdp"))])
>>> strategy.axis_name, strategy.batch_axes
(None, ('fsdp',))
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec

from trainkit.strategies.sharded import ShardedStrategy


class FSDP(ShardedStrategy):
    """Fully sharded data parallelism with ``jax.jit`` and ``NamedSharding``.

    Args:
        devices: the devices to use; all devices by default.
        min_shard_size: leaves with fewer elements stay replicated (sharding them costs more
            in collectives than it saves in memory).
        rules: ``[(regex, PartitionSpec), ...]`` matched with ``re.search`` against names like
            ``params/Dense_0/kernel`` (the optimizer moments of a parameter follow it). A leaf
            matched by two rules is an error.
    """

    batch_axes = ("fsdp",)
    fsdp_axis = "fsdp"

    def __init__(
        self,
        devices: Sequence[jax.Device] | None = None,
        min_shard_size: int = 2**10,
        rules: Sequence[tuple[str, PartitionSpec]] = (),
    ):
        super().__init__({"fsdp": None}, devices=devices, rules=rules, min_shard_size=min_shard_size)
