"""Where the state lives: a table of every leaf's placement, and one leaf drawn on the mesh.

>>> import numpy as np, optax, flax.linen as nn, trainkit as tk
>>> trainer = tk.Trainer(nn.Dense(64), loss="mse", optimizer=optax.sgd(0.1), strategy=tk.FSDP(min_shard_size=8))
>>> _ = trainer.init((np.zeros((8, 16), np.float32), np.zeros((8, 64), np.float32)))
>>> rows = sharding_rows(trainer)
>>> [(r.path, r.shape, r.spec, r.device_bytes) for r in rows]
[('params/bias', (64,), 'P(fsdp)', 32), ('params/kernel', (16, 64), 'P(None,fsdp)', 512)]
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import flax.serialization
import jax
import numpy as np
from jax.sharding import NamedSharding
from rich.console import Console
from rich.table import Table

from trainkit.core import cost
from trainkit.core.state import TrainState, abstract
from trainkit.core.totals import pack
from trainkit.core.tree import PyTree, TreeFunction, leaf_name
from trainkit.loop.hooks import CompiledSteps
from trainkit.record.session import Session
from trainkit.strategies import Strategy


class CompiledTrainer(Protocol):
    """What these helpers read of a trainer: its session and live state, its strategy, and its
    compiled steps (a :class:`trainkit.Trainer` is one)."""

    @property
    def session(self) -> Session: ...

    @property
    def state(self) -> TrainState | None: ...

    @property
    def strategy(self) -> Strategy | None: ...

    @property
    def compiled(self) -> CompiledSteps: ...

    def function(self, kind: str) -> TreeFunction: ...


@dataclasses.dataclass(frozen=True)
class LeafPlacement:
    """One array of the state: its name, shape, dtype, ``PartitionSpec`` and bytes per device."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str
    device_bytes: int
    total_bytes: int


def _state(trainer_or_state: CompiledTrainer | TrainState) -> TrainState:
    state = trainer_or_state if isinstance(trainer_or_state, TrainState) else trainer_or_state.state
    if state is None:
        raise RuntimeError("The trainer has no state yet: call fit(...) or init(sample_batch) first.")
    return state


def _strategy(trainer: CompiledTrainer) -> Strategy:
    if trainer.strategy is None:
        raise RuntimeError("The trainer has no strategy yet: call fit(...) or init(sample_batch) first.")
    return trainer.strategy


def _part(state: TrainState, part: str) -> PyTree:
    """``state.<part>`` (``"params"``, ``"opt_state"``, ``"model_state"``), or the whole state for ``""``."""
    return flax.serialization.to_state_dict(state)[part] if part else state


def _spec_text(sharding: jax.sharding.Sharding) -> str:
    if not isinstance(sharding, NamedSharding):
        return type(sharding).__name__
    spec = sharding.spec
    return (
        "P("
        + ",".join(str(entry) if not isinstance(entry, tuple) else "(" + ",".join(entry) + ")" for entry in spec)
        + ")"
    )


def sharding_rows(trainer_or_state: CompiledTrainer | TrainState, part: str = "params") -> list[LeafPlacement]:
    """A :class:`LeafPlacement` per leaf of ``state.<part>`` (``"params"``, ``"opt_state"``,
    ``"model_state"``, or ``""`` for the whole state)."""
    tree = _part(_state(trainer_or_state), part)
    rows = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not isinstance(leaf, jax.Array):
            continue
        shard = leaf.addressable_shards[0].data
        rows.append(
            LeafPlacement(
                path=(part + "/" if part else "") + leaf_name(path),
                shape=tuple(leaf.shape),
                dtype=str(leaf.dtype),
                spec=_spec_text(leaf.sharding),
                device_bytes=int(shard.nbytes),
                total_bytes=int(leaf.nbytes),
            )
        )
    return rows


def describe_sharding(
    trainer_or_state: CompiledTrainer | TrainState, part: str = "params", *, console: Console | None = None
) -> Table:
    """Prints (and returns) a table of each leaf's path, shape, dtype, ``PartitionSpec`` and
    bytes per device, with the totals; ``part`` as in :func:`sharding_rows`."""
    rows = sharding_rows(trainer_or_state, part)
    strategy = None if isinstance(trainer_or_state, TrainState) else trainer_or_state.strategy
    title = f"{part or 'state'} on {strategy.describe()}" if strategy is not None else (part or "state")
    table = Table(title=title)
    for column in ("path", "shape", "dtype", "spec", "bytes/dev", "%"):
        table.add_column(column, justify="right" if column in ("bytes/dev", "%") else "left", no_wrap=True)
    for r in rows:
        share = r.device_bytes / r.total_bytes if r.total_bytes else 1.0
        table.add_row(
            r.path, "x".join(map(str, r.shape)) or "scalar", r.dtype, r.spec, f"{r.device_bytes:,}", f"{share:.0%}"
        )
    device, total = sum(r.device_bytes for r in rows), sum(r.total_bytes for r in rows)
    table.add_section()
    table.add_row("total", "", "", "", f"{device:,}", f"{device / total:.0%}" if total else "")
    (console or Console()).print(table)
    return table


def visualize_leaf(trainer_or_state: CompiledTrainer | TrainState, path: str, part: str = "params") -> None:
    """Draws the placement of one 1-D or 2-D leaf over the devices with
    ``jax.debug.visualize_array_sharding``; ``path`` as printed by :func:`describe_sharding`
    (``"params/Dense_0/kernel"``)."""
    tree = _part(_state(trainer_or_state), part)
    leaves = {
        (part + "/" if part else "") + leaf_name(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }
    if path not in leaves:
        near = [name for name in leaves if path.split("/")[-1] in name][:5]
        raise KeyError(f"No leaf named {path!r}; leaves with that ending: {near or sorted(leaves)[:5]}.")
    leaf = leaves[path]
    if np.ndim(leaf) not in (1, 2):
        raise ValueError(
            f"{path} has shape {tuple(leaf.shape)}; visualize_array_sharding draws 1-D or 2-D "
            "arrays only. describe_sharding shows every leaf's PartitionSpec."
        )
    jax.debug.visualize_array_sharding(leaf)


def _step_batch(trainer: CompiledTrainer, batch: PyTree) -> PyTree:
    """``batch``, else the shapes of the last ``fit``'s batches, for a trainer that has a state."""
    if trainer.state is None:
        raise RuntimeError("The trainer has no state yet: call fit(...) or init(sample_batch) first.")
    if batch is None:
        batch = trainer.session.batch_spec
    if batch is None:
        raise ValueError("Pass a sample batch, e.g. trainer.lowered_text((x[:32], y[:32])), or call fit first.")
    return batch


def lower_train_step(trainer: CompiledTrainer, batch: PyTree = None) -> jax.stages.Lowered:
    """The trainer's compiled train step lowered for ``batch`` (a batch placed by the strategy,
    or its abstract shapes), by default the shapes of the last ``fit``'s batches; ``.as_text()``
    is its StableHLO, ``.compile().as_text()`` the partitioned HLO with the collectives the
    compiler inserted."""
    batch = _step_batch(trainer, batch)
    function = trainer.function("train")
    if not hasattr(function, "lower"):  # a jax.jit or jax.pmap function
        raise TypeError(
            f"{type(trainer.strategy).__name__}.compile('train', ...) returned a function without .lower()."
        )
    lowered: jax.stages.Lowered = function.lower(
        abstract(trainer.state), pack(trainer.compiled.empty_totals("train")), batch
    )
    return lowered


def step_flops(trainer: CompiledTrainer, batch: PyTree = None) -> float | None:
    """The floating-point operations of one train step on all devices together, from the
    lowered (unoptimised) step's cost analysis, on ``batch`` (as :func:`lower_train_step`): the
    model's own flops, which MFU counts, without the compiler's rewrites, but with ``remat``'s
    recomputed forward pass (see :func:`compiled_step_flops`). ``None`` when the backend
    reports none."""
    flops = cost.flops(lower_train_step(trainer, batch))
    if flops is None:
        return None
    strategy = _strategy(trainer)
    per_device_program = strategy.axis_name is not None  # pmap lowers one device's program
    return flops * (len(strategy.devices) if per_device_program else 1)


def model_step_flops(trainer: CompiledTrainer, batch: PyTree = None) -> float | None:
    """One train step's flops on all devices together as the model's own matrix multiplies count
    them, as MaxText and PaLM count MFU: three times the forward pass's, causal ``tk.attention``
    halved (:func:`trainkit.core.cost.model_flops`), the same under every strategy and with or
    without remat, a Pallas kernel's included (the compiler counts a kernel as nothing). On the
    inputs of ``batch`` (as :func:`lower_train_step`; by default the last ``fit``'s); ``None``
    where the model has no matrix multiply.

    >>> import numpy as np, optax, flax.linen as nn, trainkit as tk
    >>> trainer = tk.Trainer(nn.Dense(3), loss="mse", optimizer=optax.sgd(0.1))
    >>> _ = trainer.fit(np.ones((32, 5), np.float32), np.ones((32, 3), np.float32), batch_size=16, verbose=0)
    >>> model_step_flops(trainer)  # 3 x (2 x 16 rows x 5 inputs x 3 outputs)
    1440.0
    """
    inputs = _step_batch(trainer, batch)["x"]
    per_device_rows = _strategy(trainer).axis_name is not None  # pmap places (devices, rows, ...)

    def whole(leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        shape = (leaf.shape[0] * leaf.shape[1], *leaf.shape[2:]) if per_device_rows else leaf.shape
        return jax.ShapeDtypeStruct(shape, leaf.dtype)

    flops = trainer.compiled.model_flops(jax.tree.map(whole, inputs))
    return flops or None


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """A train step's floating-point operations as the compiler counts them: ``per_device`` (the
    compiled program one device runs, after partitioning and XLA's simplifications), ``total``
    (on all the step's devices), and ``model`` (the lowered step's count on all devices, before
    XLA optimises it). Both include ``remat``'s recomputation (``jax.checkpoint`` puts it in the
    gradient's program): the model's own operations, which MFU conventionally divides by, are
    the counts of the same trainer without remat. ``total / model`` is what compiling changed:
    partitioning's redundant work above 1, simplifications below."""

    per_device: float
    total: float
    model: float | None

    @property
    def recomputed(self) -> float | None:
        """``total / model``: the compiled step's work over the model's (``None``: unknown)."""
        return None if not self.model else self.total / self.model


def compiled_step_flops(trainer: CompiledTrainer, batch: PyTree = None) -> StepFlops | None:
    """The train step's flops from the *compiled* step's cost analysis, per device and in total,
    under any strategy (``None`` when the backend reports none). It compiles the step once more
    (a persistent compilation cache hit when the cache is on); ``batch`` as :func:`lower_train_step`.

    >>> import numpy as np, optax, flax.linen as nn, trainkit as tk
    >>> trainer = tk.Trainer(nn.Dense(256), loss="mse", optimizer=optax.sgd(0.1), strategy=tk.FSDP(min_shard_size=8))
    >>> _ = trainer.fit(np.ones((64, 256), np.float32), np.ones((64, 256), np.float32), batch_size=64, verbose=0)
    >>> flops = compiled_step_flops(trainer)
    >>> flops.total == flops.per_device * 8, 0.9 < flops.recomputed < 1.3
    (True, True)
    """
    lowered = lower_train_step(trainer, batch)
    per_device = cost.flops(lowered.compile())
    if per_device is None:
        return None
    strategy = _strategy(trainer)
    devices = len(strategy.devices)
    model = cost.flops(lowered)
    per_device_program = strategy.axis_name is not None  # pmap lowers one device's program too
    return StepFlops(
        per_device, per_device * devices, None if model is None else model * (devices if per_device_program else 1)
    )
