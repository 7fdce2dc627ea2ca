"""Keras's ``model.summary()`` for a trainer: every module of the forward pass (parameter-free
ones such as ``Dropout`` too) with its output shape and parameter count, the totals with their
sizes, and the train step's FLOPs from XLA's cost analysis.

>>> import numpy as np, optax, flax.linen as nn, trainkit as tk
>>> class Two(nn.Module):
...     @nn.compact
...     def __call__(self, x):
...         return nn.Dense(1)(nn.Dropout(0.5, deterministic=True)(x))
>>> trainer = tk.Trainer(Two(), loss="mse", optimizer=optax.sgd(0.1), strategy="single")
>>> _ = trainer.init((np.zeros((4, 2), np.float32), np.zeros((4, 1), np.float32)))
>>> [tuple(row) for row in summary_rows(trainer.program.adapter, trainer.state, np.zeros((1, 2), np.float32))]
[('Dropout_0', 'Dropout', '(None, 2)', 0), ('Dense_0', 'Dense', '(None, 1)', 3)]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np
from rich.console import Group
from rich.table import Table
from rich.text import Text

from trainkit.core.model import ModelAdapter
from trainkit.core.state import TrainState, abstract
from trainkit.core.trainable import Trainable
from trainkit.core.tree import PyTree, tree_bytes
from trainkit.monitoring import debug


class SummaryInputs(Protocol):
    """What ``summary`` shows (``Setup.summary_inputs`` builds it): abstract inputs ``x`` of a few
    examples, the ``state`` (live, or its shapes), the placed sample batch to lower the train step
    on (``None``: the last ``fit``'s), or, traced without a strategy, its ``flops`` on ``flops_rows`` rows."""

    @property
    def x(self) -> PyTree: ...

    @property
    def state(self) -> TrainState: ...

    @property
    def step_batch(self) -> PyTree: ...

    @property
    def flops(self) -> float | None: ...

    @property
    def flops_rows(self) -> int | None: ...


class ModelProgram(Protocol):
    """What ``summary`` reads of the trainer's program: the model, which parameters train, its outputs."""

    @property
    def adapter(self) -> ModelAdapter: ...

    @property
    def trainable(self) -> Trainable: ...

    def outputs(self, state: TrainState, x: PyTree) -> PyTree: ...


class SummarizedTrainer(debug.CompiledTrainer, Protocol):
    """What ``summary`` reads of a trainer besides its compiled steps: the model and its program."""

    @property
    def model(self) -> object: ...

    @property
    def program(self) -> ModelProgram: ...


class SummaryRow(NamedTuple):
    """One module: its path (``Block_0/Dense_1``), class, output shape as Keras prints it
    (``(None, 10)``; ``?`` unknown) and the variables under it (parameters and model state)."""

    path: str
    kind: str
    output_shape: str
    params: int


def _shape_text(output: PyTree, rows: int) -> str:
    """Keras's shape text; a leading axis of the traced batch's ``rows`` is the batch (None)."""
    if output is None:
        return "?"
    texts = [
        "(" + ", ".join("None" if i == 0 and d == rows else str(d) for i, d in enumerate(leaf.shape)) + ")"
        for leaf in jax.tree.leaves(output)
    ]
    return texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"


def _under(tree: PyTree, path: tuple[Any, ...]) -> PyTree:
    for key in path:
        if not isinstance(tree, Mapping) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _count(tree: PyTree) -> int:
    return sum(int(np.prod(np.shape(leaf))) for leaf in jax.tree.leaves(tree))


def summary_rows(adapter: ModelAdapter, state: TrainState, x: PyTree) -> list[SummaryRow]:
    """The rows of :func:`summary_view`: the modules ``adapter`` (the model's) calls on inputs
    ``x`` (a few examples, abstract: see ``Setup.summary_inputs``) with the variables of
    ``state`` (live or abstract)."""
    batch = jax.tree.leaves(x)[0].shape[0]
    state = abstract(state)
    params, model_state = state.params, state.model_state
    calls = adapter.module_calls(params, model_state, x)
    rows = []
    for call in calls:
        if call.path == ():
            continue
        count = _count(_under(params, call.path))
        count += sum(_count(_under(collection, call.path)) for collection in dict(model_state).values())
        rows.append(SummaryRow("/".join(map(str, call.path)), call.kind, _shape_text(call.output, batch), count))
    return rows


def readable_size(size: float) -> str:
    """Keras's ``readable_memory_size``: ``136.04 KB``.

    >>> readable_size(139304), readable_size(0)
    ('136.04 KB', '0.00 B')
    """
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size / 1024 < 1:
            return f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} PB"


def summary_view(trainer: SummarizedTrainer, inputs: SummaryInputs | None) -> Group:
    """Keras's summary: ``Model: "<class>"``, a row per module (``Layer (type)``, ``Output
    Shape``, ``Param #``: a module counts the variables of its submodules too), then total,
    trainable, non-trainable and optimizer parameters with their sizes (the total includes the
    optimizer state, as Keras's does once its optimizer is built: trainkit builds it at
    ``init``), the model's output shape, and the FLOPs of one train step on the sample batch
    (default: the last ``fit``'s batches). ``inputs``: ``Setup.summary_inputs``'s."""
    if inputs is None:
        raise RuntimeError(
            "summary() needs the model's input shapes: pass a sample batch, trainer.summary((x[:32], y[:32])), "
            "or call it after fit(...) or init(...)."
        )
    x, state = inputs.x, inputs.state
    program = trainer.program
    rows = summary_rows(program.adapter, state, x)
    table = Table()
    table.add_column("Layer (type)", no_wrap=True)
    table.add_column("Output Shape")
    table.add_column("Param #", justify="right")
    for row in rows:
        depth = row.path.count("/")
        table.add_row("  " * depth + f"{row.path.rsplit('/', 1)[-1]} ({row.kind})", row.output_shape, f"{row.params:,}")
    trained, frozen = program.trainable.partition(state.params)  # frozen parameters count as non-trainable
    parts = {"Trainable": trained, "Non-trainable": [frozen, state.model_state], "Optimizer": state.opt_state}
    lines = [
        f"Total params: {sum(map(_count, parts.values())):,} ({readable_size(sum(map(tree_bytes, parts.values())))})",
        *(f"{name} params: {_count(tree):,} ({readable_size(tree_bytes(tree))})" for name, tree in parts.items()),
    ]
    output = jax.eval_shape(program.outputs, abstract(state), x)
    lines.append(f"Output shape: {_shape_text(output, jax.tree.leaves(x)[0].shape[0])}")
    lines.append(_flops_line(trainer, inputs))
    return Group(Text(f'Model: "{type(trainer.model).__name__}"', style="bold"), table, Text("\n".join(lines)))


def _flops_line(trainer: SummarizedTrainer, inputs: SummaryInputs) -> str:
    """``Train step FLOPs: ... per batch of N (XLA's cost analysis)``, or how to get them."""
    if inputs.flops_rows is not None:  # traced without a strategy
        flops, rows_in_batch = inputs.flops, inputs.flops_rows
    else:
        batch = inputs.step_batch if inputs.step_batch is not None else trainer.session.batch_spec
        if batch is None:
            return "Train step FLOPs: pass a batch with targets, summary((x, y)), to count them"
        flops, rows_in_batch = debug.step_flops(trainer, batch), int(np.prod(np.shape(batch["mask"])))
    shown = "unknown" if flops is None else f"{flops:,.0f}"
    return f"Train step FLOPs: {shown} per batch of {rows_in_batch} (XLA's cost analysis)"
