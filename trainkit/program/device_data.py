"""``fit(..., data_on_device=)``: whether in-memory arrays are kept on the devices, so that a
fused call (``steps_per_execution > 1``) gathers its batches there from the rows it is sent,
instead of the host gathering them and sending the rows' values.

``True`` asks for it and is refused by name where it cannot be: data that is not in-memory
arrays (an iterable, a generator, a random-access source), a strategy that does not gather on
its devices (``DataParallel``'s ``pmap``; a context axis or a pipeline), several processes,
or a table larger than :data:`DEVICE_SHARE` of one device's memory. ``"auto"`` takes it where
``True`` would be accepted and the devices are accelerators: on a CPU the "device" memory is
the host's, so nothing crosses a bus, and keeping the data there measured no faster
(docs/performance.md, "A fused call's input"). The numbers are the same either way: the call
gathers exactly the rows, padding and masks the host would have sent.

>>> import numpy as np, trainkit as tk
>>> from trainkit.data import ArrayDataset
>>> decide(True, ArrayDataset(np.zeros((64, 4), np.float32)), tk.SingleDevice())
True
>>> decide("auto", ArrayDataset(np.zeros((64, 4), np.float32)), tk.SingleDevice())  # a CPU
False
"""

from __future__ import annotations

import jax
import numpy as np

from trainkit.data import Source
from trainkit.planning.plan import device_memory_limit
from trainkit.strategies import Strategy
from trainkit.strategies.base import GATHERING_SPLIT_BATCH

#: The share of one device's memory (``device_memory_limit``) the kept rows may take: the rest is
#: the step's (its state, activations and the batches in flight).
DEVICE_SHARE = 0.25


def table_bytes(source: Source) -> int:
    """The bytes every device keeps of ``source``'s rows (:meth:`~trainkit.data.Source.table`),
    as the devices hold them (64-bit NumPy values as JAX's 32-bit ones)."""
    leaves = jax.tree.leaves(source.table())
    return sum(int(np.prod(np.shape(a))) * min(np.dtype(a.dtype).itemsize, 4) for a in leaves)


def refusal(source: Source, strategy: Strategy) -> str | None:
    """Why the rows of ``source`` cannot be kept on ``strategy``'s devices (``None``: they can)."""
    if not source.gathers_rows:
        return (
            f"the data is {type(source).__name__}, not in-memory arrays: its rows are read as it yields them, so "
            "there is no table to keep on the devices"
        )
    if not strategy.gathers_on_device:
        return f"{strategy!r} does not gather a fused call's batches on its devices (DataParallel's pmap)"
    if strategy.context_axis is not None or strategy.stage_axis is not None:
        return f"{strategy!r}: {GATHERING_SPLIT_BATCH}"
    if jax.process_count() > 1:
        return f"this job has {jax.process_count()} processes, and the rows are kept per process only with one"
    needed, limit = table_bytes(source), device_memory_limit(strategy.devices)
    if needed > DEVICE_SHARE * limit:
        return (
            f"the rows take {needed / 2**20:.1f} MiB on every device, more than {DEVICE_SHARE:.0%} of its "
            f"{limit / 2**30:.2f} GiB (the rest is the step's)"
        )
    return None


def decide(setting: bool | str, source: Source, strategy: Strategy) -> bool:
    """``fit``'s ``data_on_device`` resolved: ``True`` where asked and possible (refused with the
    reason otherwise), ``"auto"`` where possible on an accelerator, ``False`` as asked."""
    if setting is False:
        return False
    reason = refusal(source, strategy)
    if setting is True and reason is not None:
        raise ValueError(
            f"fit(data_on_device=True): {reason}. Pass data_on_device='auto' (kept there where it can be) or False."
        )
    return reason is None and (setting is True or strategy.devices[0].platform != "cpu")
