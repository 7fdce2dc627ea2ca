"""The Strategy protocol: the only code that knows devices exist.

A strategy owns a mesh and decides where every leaf of the state and every batch lives, and
how the pure step functions are compiled. It never sees the loss, optimizer, callbacks or files.

>>> import jax
>>> mesh = make_mesh(jax.devices()[:2], (2,), ("data",))
>>> dict(mesh.shape)
{'data': 2}
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainkit.core.model import LogicalRule
from trainkit.core.offload import Offload
from trainkit.core.remat import Remat
from trainkit.core.tree import Leaf, PyTree, TreeFunction


def make_mesh(devices: Sequence[jax.Device], shape: Sequence[int], names: Sequence[str]) -> Mesh:
    """A mesh with explicitly ``Auto`` axis types, whatever the JAX version's default."""
    array = np.asarray(devices, dtype=object).reshape(tuple(shape))
    return Mesh(array, tuple(names), axis_types=(jax.sharding.AxisType.Auto,) * len(names))


#: why a strategy that gathers on its devices cannot under a context axis or a pipeline
GATHERING_SPLIT_BATCH = (
    "under a context axis or a pipeline the step splits or schedules the batch it is given, so a fused call cannot "
    "gather its batches from data kept on the devices"
)


class Strategy:
    """Base class of every strategy; subclass it and override the members below.

    Members a strategy provides:

    - ``mesh``: the devices and their axis names.
    - ``axis_name``: the device axis the step reduces over by hand (``pmap``/``shard_map``),
      or ``None`` when the compiler inserts collectives from shardings (``jit``).
    - ``num_batch_shards``: how many equal parts a global batch is split into.
    - ``state_sharding(abstract_state)``: a sharding for every leaf of the state.
    - ``put_batch(host_batch)``: a NumPy batch -> device arrays.
    - ``compile(kind, fn, abstract_state)``: the one compile entry point, for ``"train"``
      (``fn(state, totals, batch) -> (state, totals)``, the state donated), ``"train_steps"``
      (the same over ``k`` batches stacked on a new leading axis, trained in one call:
      ``steps_per_execution``, with ``put_batches(host_batches)``), ``"eval"``
      (``fn(state, totals, batch) -> totals``) and ``"predict"`` (``fn(state, batch)``, one
      output row per example). ``totals`` is the epoch's metric totals
      (:class:`trainkit.core.totals.PackedTotals`, small, replicated, not donated). By default
      it calls the hooks ``compile_train``, ``compile_train_steps``, ``compile_eval`` and
      ``compile_predict``; override either.
    - ``fetch_rows(tree)``: per-row device outputs -> host NumPy ``(global_batch, ...)``.

    Configured at construction; ``with_annotations(param_axes)`` returns a new strategy that
    places annotated parameters by its ``logical_rules``. Shared, rarely overridden:
    ``create_state`` (the state built directly in its shardings; ``precompile_state`` compiles
    it without running, for ``"auto"`` to do beside other compiles), ``put_state``, ``put_like``
    (host values into the shardings of live arrays), ``batch_share`` (which part of every global
    batch this process reads), ``local_rows`` (this process's rows of a global batch) and
    ``real_rows`` (the real rows of the global batch, from this process's mask).
    """

    axis_name: str | None = None
    #: Whether it can train ``k`` stacked batches in one call (``steps_per_execution``): a
    #: strategy that implements ``put_batches`` and compiles ``"train_steps"`` declares ``True``.
    fuses_steps: bool = False
    #: Whether a fused call can gather its batches from data kept on the devices
    #: (``fit(..., data_on_device=True)``): a strategy that compiles ``"train_steps_gathered"``
    #: (``fn(state, totals, {"table", "rows", "mask"})``, the table replicated, the rows and masks
    #: split as stacked batches are) and places the table with ``put_table`` declares ``True`` (it is
    #: refused all the same under a context axis or a pipeline: :data:`GATHERING_SPLIT_BATCH`).
    gathers_on_device: bool = False
    #: Whether it can keep the optimizer's state in host memory (``Trainer(offload="optimizer")``):
    #: a strategy whose ``state_sharding`` places it as :meth:`with_offload` says declares ``True``.
    offloads: bool = False
    #: Where the state lives (:class:`trainkit.core.offload.Offload`): set by :meth:`with_offload`.
    offload: Offload = Offload()
    #: Remat the train step adds on top of the trainer's (``None``: none): set by :meth:`with_remat`,
    #: which a plan's added measure uses (``strategy="auto"`` when nothing fits).
    remat: Remat = None
    #: Flax logical axis name -> mesh axes, for parameters annotated with
    #: ``nn.with_logical_partitioning`` and for ``nn.with_logical_constraint`` (none by default).
    logical_rules: tuple[LogicalRule, ...] = ()
    #: The mesh axis each row's sequence (the batch arrays' ``sequence_axis``) is split over inside
    #: the step (``None``: none).
    context_axis: str | None = None
    sequence_axis: int = 1
    #: Under a context axis, also split the attention a model calls by JAX's or Flax's own names
    #: (``Hybrid(reach_attention=True)``; :mod:`trainkit.attn.reach`).
    reach_attention: bool = False
    #: The mesh axis a pipeline splits the model's stacked blocks over (``None``: no pipeline), and
    #: into how many microbatches each step's batch goes through it (:mod:`trainkit.strategies.pipeline`).
    stage_axis: str | None = None
    microbatches: int = 1
    #: The stacked blocks' parameter paths the stages split along their layer axis: set by
    #: :meth:`with_stages`, from the model.
    stage_paths: tuple[str, ...] = ()

    @property
    def mesh(self) -> Mesh:
        raise NotImplementedError

    @property
    def devices(self) -> list[jax.Device]:
        return list(self.mesh.devices.flat)

    @property
    def num_batch_shards(self) -> int:
        return 1

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def state_sharding(self, abstract_state: PyTree) -> PyTree:
        """Default: every leaf replicated on every device of the mesh."""
        return jax.tree.map(lambda _: self.replicated(), abstract_state)

    def with_offload(self, offload: Offload) -> Strategy:
        """A copy that keeps what ``offload`` names in host memory (this strategy is left as it
        is); itself when ``offload`` names nothing. Only a strategy that ``offloads`` can."""
        if not offload:
            return self
        if not self.offloads:
            raise ValueError(self.no_offload())
        placed = copy.copy(self)
        placed.offload = offload
        return placed

    def with_remat(self, remat: Remat) -> Strategy:
        """A copy whose compiled train step rematerialises ``remat``
        (:func:`trainkit.core.remat.rematerialised`); this strategy is left as it is."""
        measured = copy.copy(self)
        measured.remat = remat
        return measured

    def with_stages(self, paths: Sequence[str]) -> Strategy:
        """A copy whose ``stage_axis`` splits the parameters at ``paths`` (the model's stacked
        blocks) along their leading layer axis; this strategy is left as it is."""
        staged = copy.copy(self)
        staged.stage_paths = tuple(paths)
        return staged

    def no_offload(self) -> str:
        """Why this strategy cannot keep the optimizer's state in host memory, and what to do."""
        return (
            f"{type(self).__name__} cannot keep the optimizer's state in host memory (offload='optimizer'): it does "
            "not declare offloads = True. Use strategy='single', tk.FSDP() or tk.Hybrid(...), or offload=None."
        )

    def create_state(self, init_fn: Callable[..., PyTree], *args: PyTree) -> PyTree:
        """Runs ``init_fn(*args)`` compiled with the state's shardings as its outputs, so the
        state is never whole on one device first."""
        return self._state_function(init_fn, *args)(*args)

    def precompile_state(self, init_fn: Callable[..., PyTree], *args: PyTree) -> None:
        """Compiles what ``create_state(init_fn, *args)`` runs, without running it: JAX keeps
        the executable, so a later ``create_state`` with the same ``init_fn`` object does not
        compile. ``"auto"`` calls it in a thread while it compiles the candidates' steps."""
        self._state_function(init_fn, *args).lower(*args).compile()

    def _state_function(self, init_fn: Callable[..., PyTree], *args: PyTree) -> jax.stages.Wrapped:
        abstract = jax.eval_shape(init_fn, *args)
        return jax.jit(init_fn, out_shardings=self.state_sharding(abstract))

    def put_state(self, state: PyTree) -> PyTree:
        """Places a (host or device) state into this strategy's shardings."""
        return jax.device_put(state, self.state_sharding(state))

    def put_replicated(self, tree: PyTree) -> PyTree:
        """Host values on every device of the mesh (the metric totals a step carries)."""
        return jax.device_put(tree, self.replicated())

    def put_table(self, table: PyTree) -> PyTree:
        """Every row of in-memory data on every device (``data_on_device``): replicated."""
        return self.put_replicated(table)

    def put_like(self, tree: PyTree, like: PyTree) -> PyTree:
        """Host (or device) values placed in the shardings of the live arrays ``like``."""
        return jax.device_put(tree, jax.tree.map(lambda a: a.sharding, like))

    def batch_share(self) -> tuple[int, int]:
        """Which equal part of every global batch this process reads, of how many: ``(index,
        count)``. By default each process its own part (``(process_index, process_count)``); a
        strategy whose devices on several processes take the same rows (a stage axis across
        hosts) has those processes read the same part."""
        return jax.process_index(), jax.process_count()

    def local_rows(self, global_batch: PyTree) -> PyTree:
        """This process's part of a global host batch: rows ``[i * b, (i + 1) * b)`` of its
        :meth:`batch_share` ``(i, n)``, ``b`` the batch's rows over ``n``."""
        index, count = self.batch_share()
        if jax.process_count() == 1:
            return global_batch
        rows = np.shape(jax.tree.leaves(global_batch)[0])[0] // count

        def part(a: np.ndarray | jax.Array | jax.ShapeDtypeStruct) -> Leaf:
            if isinstance(a, jax.ShapeDtypeStruct):  # an abstract batch (a plan from shapes): its part's shape
                return jax.ShapeDtypeStruct((rows, *a.shape[1:]), a.dtype)
            return a[index * rows : (index + 1) * rows]

        return jax.tree.map(part, global_batch)

    def real_rows(self, local_mask: np.ndarray) -> int:
        """Real rows of the global batch whose part on this process has ``local_mask`` (real
        rows come first, padding follows)."""
        local = int(np.asarray(local_mask).sum())
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils

        every = int(np.asarray(multihost_utils.process_allgather(np.asarray(local))).sum())
        return int(every * self.batch_share()[1] // jax.process_count())  # processes sharing a part counted once

    def with_annotations(self, param_axes: dict[str, tuple[str | None, ...]]) -> Strategy:
        """This strategy configured with the model's parameter annotations
        (``{"Block_0/Dense_0/kernel": ("embed", "mlp")}``), which a strategy with
        ``logical_rules`` places by; a new strategy, this one unchanged. The default has no
        logical rules and returns itself."""
        return self

    def put_batch(self, host_batch: PyTree) -> PyTree:
        raise NotImplementedError

    def abstract_batch(self, host_batch: PyTree) -> PyTree:
        """A host batch as lowering takes it with nothing placed (a plan for devices that are
        not here: compile-only TPU or GPU devices hold no data). The default is
        :meth:`put_batch`'s result, which a strategy whose ``put_batch`` places arrays overrides."""
        return self.put_batch(host_batch)

    def trace_parts(self) -> tuple[object, ...]:
        """What every step it compiles is traced under (parts of the step's trace context,
        :mod:`trainkit.core.trace_context`), handed to the step once with the platform by the
        program's compile: a mesh's logical axis rules, a context split, a pipeline's schedule.
        The default: none."""
        return ()

    def compile(self, kind: str, fn: TreeFunction, abstract_state: PyTree) -> TreeFunction:
        """The one compile entry point: ``fn`` compiled for ``kind`` (``"train"``: the state
        donated; ``"train_steps"``: the same over ``k`` stacked batches; ``"eval"``: outputs
        reduced over devices; ``"predict"``: one output row per example). The default calls
        the ``compile_<kind>`` hook below, which a custom strategy may override instead."""
        hooks = {"train": self.compile_train, "train_steps": self.compile_train_steps, "eval": self.compile_eval}
        if kind == "train_steps_gathered":
            raise NotImplementedError(
                f"{type(self).__name__} cannot gather a fused call's batches from data on the devices (it does not "
                "declare gathers_on_device = True). Pass fit(..., data_on_device=False), or use strategy='single', "
                "tk.FSDP() or tk.Hybrid(...)."
            )
        return hooks.get(kind, self.compile_predict)(fn, abstract_state)

    def compile_train(self, step_fn: TreeFunction, abstract_state: PyTree) -> TreeFunction:
        raise NotImplementedError

    def put_batches(self, host_batches: PyTree) -> PyTree:
        """``k`` NumPy batches stacked on a new leading axis -> device arrays, each batch split
        as ``put_batch`` splits it (for ``steps_per_execution``)."""
        raise NotImplementedError(self._no_steps_per_execution())

    def compile_train_steps(self, steps_fn: TreeFunction, abstract_state: PyTree) -> TreeFunction:
        """``steps_fn(state, totals, batches)`` (``k`` steps over batches stacked on a leading
        axis), with the state donated, as ``compile_train`` compiles one step."""
        raise NotImplementedError(self._no_steps_per_execution())

    def _no_steps_per_execution(self) -> str:
        return (
            f"{type(self).__name__} does not implement put_batches and compile_train_steps, which "
            "steps_per_execution > 1 needs (it does not declare fuses_steps = True). Implement both and declare "
            "fuses_steps = True on the class (see trainkit.strategies.ShardedStrategy), or use steps_per_execution=1."
        )

    def compile_eval(self, eval_fn: TreeFunction, abstract_state: PyTree) -> TreeFunction:
        raise NotImplementedError

    def compile_predict(self, predict_fn: TreeFunction, abstract_state: PyTree) -> TreeFunction:
        """``predict_fn(state, batch)``, whose outputs have one row per example. The default
        compiles it through ``compile_eval`` (with an empty ``totals`` argument)."""
        compiled = self.compile_eval(lambda state, totals, batch: predict_fn(state, batch), abstract_state)
        return lambda state, batch: compiled(state, (), batch)

    def fetch_rows(self, tree: PyTree) -> PyTree:
        return jax.tree.map(np.asarray, jax.device_get(tree))

    def describe(self) -> str:
        return f"{type(self).__name__}({len(self.devices)} devices)"

    def __repr__(self) -> str:
        """Its class and mesh axes: ``FSDP(fsdp=8)``, ``Hybrid(data=2, fsdp=4)``."""
        try:
            axes = ", ".join(f"{name}={size}" for name, size in self.mesh.shape.items())
        except NotImplementedError:  # a custom strategy without a mesh yet
            return f"{type(self).__name__}()"
        return f"{type(self).__name__}({axes})"


def check_steps_per_execution(steps: object, strategy: Strategy | None = None) -> int:
    """``steps`` as an int, or a ``ValueError`` (not a positive integer) or ``TypeError`` (a
    ``strategy`` without ``put_batches`` / ``compile_train_steps``) saying what to pass.

    >>> check_steps_per_execution(32)
    32
    """
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps_per_execution must be a positive integer or 'auto'; received {steps!r}.")
    if steps > 1 and strategy is not None and not strategy.fuses_steps:
        raise TypeError(strategy._no_steps_per_execution())
    return int(steps)
