"""``Hybrid``: a 2-D (or 3-D) mesh of ``data`` x ``fsdp`` and/or ``model`` axes.

- ``Hybrid(data=2, fsdp=4)``: the batch is split over both axes; the state is sharded over
  ``fsdp`` (as in :class:`FSDP`) and replicated over ``data``. Gradients are reduced over all
  devices, parameters are gathered only within an ``fsdp`` group.
- ``Hybrid(data=2, model=4, rules=[...])``: tensor parallelism; the rules place kernel
  dimensions on the ``model`` axis, the batch is split over ``data``.
- ``Hybrid(data=2, context=4)``: context parallelism for long sequences; each row's sequence
  (the batch arrays' ``sequence_axis``) is split over ``context`` inside the step, so every
  activation along it is too, and the compiler gathers what attention needs (docs/large_models.md).
  Composes with ``fsdp`` and ``model``.
- ``Hybrid(data=2, stage=4, microbatches=8)``: a pipeline; the model's stacked blocks (``nn.scan``)
  are split into 4 stages along their layer axis, and each step's rows (per data group) go through
  them as 8 microbatches on a GPipe schedule (:mod:`trainkit.strategies.pipeline`). It belongs across
  slices or hosts, where only activations cross the slow network (docs/large_models.md).

One size may be left out (``None``): it is the device count divided by the others.

>>> from jax.sharding import PartitionSpec as P
>>> strategy = Hybrid(data=2, model=4, rules=[(r"Dense_0/kernel", P(None, "model"))])
>>> strategy.batch_axes, dict(strategy.mesh.shape)
(('data',), {'data': 2, 'model': 4})
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec

from trainkit.strategies.sharded import ShardedStrategy


class Hybrid(ShardedStrategy):
    """Data parallelism across groups of devices, FSDP or tensor parallelism inside each group.

    Args:
        data: devices along the ``data`` axis (batch split, state replicated); ``None``: the
            device count divided by the other sizes.
        fsdp: devices along the ``fsdp`` axis (batch split, state sharded), if any.
        model: devices along the ``model`` axis (tensor parallel: placed by ``rules``), if any.
        context: devices along the ``context`` axis (each sequence split over them), if any.
        stage: devices along the ``stage`` axis (the stacked blocks' layers split over them), if any.
        microbatches: how many microbatches a pipeline cuts each step's batch into (the stage
            count by default); the bubble each stage waits is ``(stage - 1) / (microbatches + stage - 1)``.
        sequence_axis: the batch arrays' sequence dimension (``1``: ``(rows, time, ...)``).
        rules: ``[(regex, PartitionSpec), ...]`` over leaf names like ``params/Dense_0/kernel``.
        min_shard_size: leaves with fewer elements stay replicated over ``fsdp``.
        devices: the devices to use; all devices by default.
        reach_attention: under a context axis, also split by hand the attention a model calls as
            ``jax.nn.dot_product_attention``, ``nn.dot_product_attention`` or Flax's
            ``MultiHeadDotProductAttention`` without being edited: while the step is traced those
            names are rebound (under a lock) and a Flax interceptor sees every module call, then
            all is put back. Off by default: ``tk.attention`` is split without it, and other
            attention is split by the compiler from the layout (the plan says which).
    """

    def __init__(
        self,
        data: int | None = None,
        fsdp: int | None = None,
        model: int | None = None,
        context: int | None = None,
        stage: int | None = None,
        *,
        microbatches: int | None = None,
        sequence_axis: int = 1,
        rules: Sequence[tuple[str, PartitionSpec]] = (),
        min_shard_size: int = 2**10,
        devices: Sequence[jax.Device] | None = None,
        reach_attention: bool = False,
    ):
        # the stage axis outermost: across slices or hosts, the devices' slowest links
        sizes = {"stage": stage, "data": data, "fsdp": fsdp, "model": model, "context": context}
        for name, size in (*sizes.items(), ("microbatches", microbatches)):
            if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
                raise ValueError(f"Hybrid: {name} must be a positive integer or None; received {size!r}.")
        if all(size is None for name, size in sizes.items() if name != "data"):
            raise ValueError(
                "Hybrid needs an fsdp, a model, a context or a stage axis besides data, e.g. Hybrid(data=2, fsdp=4), "
                "Hybrid(data=2, model=4, rules=[...]), Hybrid(data=2, context=4) or Hybrid(data=2, stage=4, "
                "microbatches=8); for data parallelism alone use DataParallel() or FSDP()."
            )
        if microbatches is not None and stage is None:
            raise ValueError(
                f"Hybrid: microbatches={microbatches} cuts a batch for a pipeline, and there is no stage axis; "
                f"add one (Hybrid(data=..., stage=4, microbatches={microbatches})), or use grad_accum_steps= on "
                "the trainer to accumulate gradients over micro-batches without one."
            )
        if not isinstance(sequence_axis, int) or isinstance(sequence_axis, bool) or sequence_axis < 1:
            raise ValueError(
                f"Hybrid: sequence_axis must be a positive integer (axis 0 holds the rows); received {sequence_axis!r}."
            )
        axes = {name: size for name, size in sizes.items() if name == "data" or size is not None}
        if stage is not None:
            self.stage_axis, self.microbatches = "stage", microbatches or stage
        self.context_axis = "context" if context is not None else None
        self.reach_attention = reach_attention
        self.sequence_axis = sequence_axis
        self.batch_axes = tuple(a for a in ("data", "fsdp") if a in axes)
        self.fsdp_axis = "fsdp" if fsdp is not None else None
        super().__init__(axes, devices=devices, rules=rules, min_shard_size=min_shard_size)
