"""The input of ``fit``, ``evaluate`` and ``predict`` resolved once and checked before anything
compiles: the same configuration on every process, the objective built and its targets checked,
a batch size the devices can split, the model's outputs checked on the first batch (rows kept,
no probabilities where a loss takes logits); under ``"auto"`` the strategy chosen and the state
created from the first batch. ``fit``'s training and validation data are one :class:`FitData`;
the validation data are prepared by the data layer and checked against what training built
(inputs, targets, a batch the devices split), not prepared as a second training input.

>>> import numpy as np, optax, flax.linen as nn, trainkit as tk
>>> trainer = tk.Trainer(nn.Dense(2), loss="mse", optimizer=optax.sgd(0.1), strategy="single")
>>> x, y = np.ones((8, 3), np.float32), np.ones((8, 2), np.float32)
>>> fit_data = prepare_fit(trainer.setup, FitArguments(x=x, y=y, batch_size=4, validation_data=(x, y)))
>>> fit_data.train.batch_size, fit_data.validation.batch_size, trainer.state.params["kernel"].shape
(4, 4, (3, 2))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np

from trainkit import data as data_lib
from trainkit import distributed
from trainkit.core import step as step_lib
from trainkit.core.precision import NoLossScale
from trainkit.core.state import TrainState
from trainkit.core.tree import JSON, PyTree
from trainkit.core.warn import warn_user
from trainkit.data import DataInput, FitConfig, Validation
from trainkit.program import auto as auto_lib
from trainkit.program import device_data, out_of_memory
from trainkit.program.arguments import FitArguments
from trainkit.program.program import Program
from trainkit.program.setup import Setup
from trainkit.program.step_audit import audit_own_step
from trainkit.strategies import Strategy

#: Rows of the first batch that :func:`check_outputs` runs the model on.
CHECKED_ROWS = 32


class FitData(NamedTuple):
    """``fit``'s input prepared: the training data and the completed configuration, which
    carries the validation data (``config.validation``) and the epoch's steps."""

    train: data_lib.Prepared
    config: FitConfig

    @property
    def validation(self) -> Validation | None:
        return self.config.validation


def _same_rows(rows: np.ndarray, first: np.ndarray) -> bool:
    """Every row of ``rows`` equals ``first`` to the precision of their dtype (non-finite alike)."""
    low = np.dtype(rows.dtype).itemsize < 4  # bf16 / fp16 outputs
    rows, first = rows.astype(np.float64), first.astype(np.float64)
    return bool(np.allclose(rows, first, rtol=1e-2 if low else 1e-4, atol=1e-2 if low else 1e-5, equal_nan=True))


def _check_same_configuration(setup: Setup, prepared: data_lib.Prepared, config: dict[str, JSON]) -> None:
    """Refuses processes that would train differently or hang in a collective (different batch sizes,
    row counts, strategies, ...), naming what differs (:func:`distributed.check_same_configuration`)."""
    program, decided = setup.program, setup.decided
    steps_per_execution = "auto" if decided.tunes_steps else decided.steps_per_execution  # or collectives hang
    distributed.check_same_configuration(
        {
            "batch_size": prepared.batch_size,
            "seed": program.seed,
            "grad_accum_steps": program.grad_accum_steps,
            "steps_per_execution": steps_per_execution,
            "strategy": setup.describe_strategy(),
            "precision": str(program.precision.compute_dtype),
            "inputs": str(prepared.spec),
            "rows": prepared.rows,  # different counts would hang a collective
            "batches": prepared.source.steps(prepared.batch_size),
            **config,
        }
    )


def prepare(
    setup: Setup,
    data: DataInput,
    y: PyTree = None,
    sample_weight: PyTree = None,
    batch_size: int | None = None,
    *,
    targets: bool,
    training: bool = False,
    announce: bool = False,
    config: dict[str, JSON] | None = None,
    run_steps: Callable[[data_lib.Prepared], int | None] | None = None,
) -> data_lib.Prepared:
    """The input resolved once, checked across processes, the objective built and checked on
    it, the strategy chosen and the state created from it. ``run_steps``: the steps the run
    trains on this input (``fit``), which bounds what ``"auto"`` spends comparing."""
    prepared = data_lib.prepare(data, y, sample_weight, batch_size, needs_targets=targets and not setup.custom_loss)
    changed = setup.compiled.retrace_if_changed()
    if changed:
        warn_user(f"Trainer attributes changed since its own step was traced ({'; '.join(changed)}): traced again.")
    micro_batches = setup.program.grad_accum_steps if training else 1
    prepared = capped_at_data(
        prepared, candidate_strategies(setup), micro_batches, said=training and batch_size is not None
    )
    batch_size = prepared.batch_size
    _check_same_configuration(setup, prepared, config or {})  # before anything that needs the processes to agree
    if setup.session.state is not None:  # predict / evaluate may take sequences of another length
        check_inputs(setup, prepared, other_lengths=not training)
    setup.output_spec(prepared.first_x)  # the model traced on the first batch, before anything compiles
    if targets and prepared.has_targets:
        setup.build_objective(prepared, every=True)
    if setup.decided.strategy is None:
        data_lib.check_batch_size(batch_size, 1, micro_batches=micro_batches)
        setup.choose_strategy(prepared, announce, run_steps=None if run_steps is None else run_steps(prepared))
    strategy = setup.decided.require_strategy()
    pipeline = strategy.microbatches if training else 1
    data_lib.check_batch_size(batch_size, strategy.num_batch_shards, micro_batches=micro_batches, pipeline=pipeline)
    check_shared_rows(strategy, prepared.source)
    if setup.session.state is None:
        if training and setup.auto is None:  # "auto" leaves such a strategy out; a given one is said once
            warn_changed_result(setup.program, strategy, prepared.first_x)
        setup.create_state(prepared)
        check_outputs(setup, prepared.first_x)
        if training:
            state = setup.session.require_state()
            check_loss_rows(setup.program, state, strategy, prepared, custom_loss=setup.custom_loss)
    if training:
        audit_own_step(setup.program, setup.session.require_state(), strategy, prepared)
    kind = "train" if training else "eval" if targets else "predict"
    setup.compiled.name_out_of_memory(kind, lambda error: out_of_memory.named(setup, kind, prepared, cause=error))
    if training and setup.decided.steps_per_execution == 1:
        out_of_memory.check_train_step(setup, prepared)  # where the device's memory is known
    return prepared


def check_loss_rows(
    program: Program, state: TrainState, strategy: Strategy, prepared: data_lib.Prepared, *, custom_loss: bool
) -> None:
    """A ``compute_loss`` of the user's sees each device's rows under a ``pmap`` strategy
    (``DataParallel``) and each micro-batch's with ``grad_accum_steps``: one whose rows' losses
    depend on the other rows (a contrastive loss) would compute another loss than on one device
    (NT-Xent: 1.11 under DataParallel against 2.88 on SingleDevice). Found on up to
    ``CHECKED_ROWS`` rows of the first batch in inference mode (one row replaced by another: the
    other rows' losses must not move), and refused with the fix (``custom_loss``: the trainer
    overrides ``compute_loss``; the built-in loss is per row by construction)."""
    parts = [f"{type(strategy).__name__} gives it each device's rows"] if strategy.axis_name is not None else []
    if program.grad_accum_steps > 1:
        parts.append(f"grad_accum_steps={program.grad_accum_steps} gives it each micro-batch's rows")
    if not parts or not custom_loss or program.steps.own.trains or jax.process_count() > 1:
        return
    batch = prepared.sample_batch()
    rows = min(CHECKED_ROWS, int(np.sum(batch["mask"])))
    if rows < 3:
        return
    small = data_lib.take(batch, slice(0, rows))
    changed = data_lib.take(small, np.r_[rows - 1, 1:rows])  # row 0 replaced by the last one

    def row_losses(state: PyTree, batch: PyTree) -> jax.Array:
        result = program.steps.training_loss(state.params, batch, state.rng, model_state=state.model_state, train=False)
        return step_lib.loss_parts(result, rows)[0]

    losses = jax.jit(row_losses)
    before, after = (np.asarray(losses(state, b)) for b in (small, changed))
    if not np.allclose(before[1:], after[1:], rtol=1e-5, atol=1e-6):
        raise ValueError(
            "compute_loss mixes the rows of a batch (a row's loss moved when another row changed: a contrastive "
            f"or other in-batch loss), and {' and '.join(parts)}: it would compute another loss than on one "
            "device. Write it as a train_step that gathers the global batch with state.all_rows "
            "(docs/custom_training.md), or train with strategy='fsdp' or 'single', where compute_loss sees the "
            "whole batch, and grad_accum_steps=1."
        )


def warn_changed_result(program: Program, strategy: Strategy, first_x: PyTree) -> None:
    """Says once when the given strategy trains this model on other numbers than one device
    (BatchNorm under ``DataParallel``), and how to get the same ones."""
    reason = program.changes_result(strategy, first_x)
    if reason is not None:
        warn_user(f"{reason}. SingleDevice, FSDP and Hybrid (and strategy='auto') normalise by the whole batch.")


def candidate_strategies(setup: Setup) -> list[Strategy]:
    """The setup's strategy, or under ``"auto"`` (none chosen yet) every candidate it may pick."""
    strategy = setup.decided.strategy
    return [strategy] if strategy is not None else auto_lib.candidates(setup.require_auto())


def batch_unit(candidates: Sequence[Strategy], micro_batches: int = 1) -> int:
    """The smallest global batch each of ``candidates`` (:func:`candidate_strategies`) splits
    into equal device parts, times ``micro_batches`` (gradient accumulation)."""
    return math.lcm(*(s.num_batch_shards for s in candidates)) * micro_batches


def capped_at_data(
    prepared: data_lib.Prepared, candidates: Sequence[Strategy], micro_batches: int, said: bool
) -> data_lib.Prepared:
    """As Keras: a batch size above the rows of the data is one batch of all the rows, here
    rounded up to what the devices of ``candidates`` (:func:`candidate_strategies`) split (the
    rest padded and masked, so nothing changes but the time and memory the padding would take);
    ``said``: a warning names the cap."""
    rows, size = prepared.rows, prepared.batch_size
    if rows is None or data_lib.own_batch_size(prepared.source) is not None:
        return prepared
    unit = batch_unit(candidates, micro_batches)
    capped = -(-rows // unit) * unit
    if capped >= size:
        return prepared
    if said:
        warn_user(
            f"batch_size={size} is more than the {rows} rows of the data: trained as one batch of all of them, "
            f"padded to {capped} (a multiple of the {unit} parts the devices split it into), as Keras does."
        )
    return prepared._replace(batch_size=capped)


def check_outputs(setup: Setup, first_x: PyTree) -> None:
    """Before the first update, on up to ``CHECKED_ROWS`` rows of the first batch in eval
    mode (one compiled forward pass, called twice): that the model treats the leading axis
    as the batch (the first row gets the same outputs among copies of itself), and that a loss taking
    logits does not receive probabilities (a model ported from Keras with its final
    softmax or sigmoid, which would train on another loss)."""
    if setup.custom_loss or jax.process_count() > 1:
        return
    rows = min(CHECKED_ROWS, data_lib.num_rows(first_x))
    x = data_lib.take(first_x, slice(0, rows))
    forward, state = jax.jit(setup.program.outputs), setup.session.require_state()
    outputs = jax.tree.map(np.asarray, forward(state, x))
    if rows > 1 and not setup.mixes_rows:  # the first row alone (repeated) must get its own outputs
        alone = jax.tree.map(np.asarray, forward(state, data_lib.take(x, np.zeros(rows, np.int64))))
        pairs = zip(*map(jax.tree.leaves, (outputs, alone)))
        if not all(_same_rows(b, a[:1]) for a, b in pairs):
            raise ValueError(
                f"The model mixes the rows of a batch: the first row of the first batch (inputs "
                f"{data_lib.describe_shapes(x)}) gets other outputs in a batch of copies of itself than among "
                "the other rows. Flax layers read the leading axis as the batch only when the input has the "
                "rank they expect: a Conv given images without their channel axis ((N, H, W) instead of "
                "(N, H, W, C)) convolves over the batch. Fix the input shape (x[..., None]), or, for a "
                "model that mixes rows on purpose, pass Trainer(mixes_rows=True)."
            )
    for loss, reading in setup.objective.probability_outputs(outputs):
        raise ValueError(
            f"The model's outputs look like probabilities (each of the first {rows} rows non-negative and "
            f"summing to 1, or in [0, 1] for one output), but the loss {loss} takes logits: trainkit's "
            "cross-entropies by name are Keras's with from_logits=True, so this would train on another loss "
            f"than Keras does. Pass loss={reading} (Keras's default, from_logits=False), or remove the "
            "model's final softmax / sigmoid."
        )


def one_batch_size(strategy: Strategy | None, data: DataInput) -> int:
    """A batch size holding all rows of ``data`` that ``strategy``'s devices can split (``*_on_batch``;
    ``None``: not chosen yet, any)."""
    return data_lib.one_batch_size(data, 1 if strategy is None else strategy.num_batch_shards)


def check_inputs(setup: Setup, prepared: data_lib.Prepared, *, other_lengths: bool) -> None:
    """The prepared inputs' per-example shapes against the model's: the same, or (``other_lengths``:
    ``predict``, ``evaluate``, validation) other sizes of the same rank the model can be traced on
    (a sequence of another length); a model that cannot take them gets the shape message, its error
    beside it."""
    differs = data_lib.check_same_inputs(setup.decided.input_spec, prepared.spec, other_lengths=other_lengths)
    if differs:
        try:
            setup.output_spec(prepared.first_x)
        except ValueError as error:
            raise ValueError(
                f"{differs} (Tried, as predict and evaluate take another length where a model can: {error})"
            ) from error


def prepare_run(
    setup: Setup,
    data: DataInput,
    y: PyTree,
    sample_weight: PyTree,
    batch_size: int | None,
    steps: int | None,
    *,
    targets: bool,
) -> tuple[data_lib.Source, int, int | None]:
    """``evaluate``'s input (``targets``) or ``predict``'s prepared: its source, batch size
    and the number of steps the run takes."""
    data_lib.check_positive(steps=steps)
    if not targets and isinstance(data, tuple) and len(data) > 1 and data_lib.is_array_tree(data):
        data = (data,)  # Keras: predict's x is the inputs, whatever their structure
    prepared = prepare(setup, data, y, sample_weight, batch_size, targets=targets)
    source, batch_size = prepared.source, prepared.batch_size
    return source, batch_size, source.steps(batch_size) if steps is None else steps


def _validation(
    setup: Setup, config: FitConfig, data: DataInput, batch_size: int, given_batch_size: int | None
) -> Validation:
    """``fit``'s validation data prepared, in batches of ``given_batch_size`` (``validation_batch_size``),
    else an iterable's own, else ``batch_size`` (the training one)."""
    checked = data_lib.as_dataset(data)
    data_lib.check_validation_runs(checked, config.validation_runs(), config.validation_steps)
    own_size = isinstance(checked, data_lib.IterableDataset)  # an iterable's batches are its own
    validating = prepare_validation(setup, checked, given_batch_size or (None if own_size else batch_size))
    if setup.custom_loss:  # a custom evaluation's mistakes surface before the first step, not after an epoch
        setup.compiled.empty_totals("eval", validating.sample_batch())
    return Validation(validating.source, validating.batch_size, config.validation_steps)


def prepare_fit(setup: Setup, given: FitArguments) -> FitData:
    """``fit``'s training data (``given``: its arguments) prepared (Keras's ``validation_split`` and
    ``class_weight`` applied), and its settings (``given.config``, checked first) completed: the
    epoch's steps, the validation data (in batches of ``validation_batch_size``, else the training
    batch size; an iterable's batches are its own; :func:`prepare_validation`), the non-finite
    warning, the first-step check; a ``verbose`` fit prints the strategy ``"auto"`` picks."""
    config = given.config(setup.program.seed)  # refused, if it must be, before the data are read
    source, validation_data = data_lib.as_dataset(given.x, given.y, given.sample_weight), given.validation_data
    if given.validation_split and validation_data is None:
        source, validation_data = data_lib.split_validation(source, given.validation_split)
    if given.class_weight is not None:
        source = data_lib.with_class_weight(source, given.class_weight)
    settings = config.loop_settings()

    def epoch_steps(prepared: data_lib.Prepared) -> int | None:
        return data_lib.epoch_steps(prepared.source, prepared.batch_size, config.steps_per_epoch, config.epochs or 1)

    prepared = prepare(
        setup,
        source,
        batch_size=given.batch_size,
        targets=True,
        training=True,
        announce=bool(given.verbose),
        config=settings,
        run_steps=lambda prepared: config.planned_steps(epoch_steps(prepared)),
    )
    source, batch_size = prepared.source, prepared.batch_size
    if setup.custom_loss:  # the step's own logs are named when it is traced: before the fit names its logs
        setup.compiled.empty_totals("train", prepared.sample_batch())
    steps = epoch_steps(prepared)
    config = config.until_max_steps(steps, source.one_shot)
    validation = None
    if validation_data is not None:
        validation = _validation(setup, config, validation_data, batch_size, given.validation_batch_size)
    return FitData(
        prepared,
        dataclasses.replace(
            config,
            steps=steps,
            validation=validation,
            warn_non_finite=config.warn_non_finite
            and isinstance(setup.session.require_state().loss_scale, NoLossScale),
            continuing=data_lib.continues_across_epochs(source, batch_size, config.steps_per_epoch),
            data_on_device=device_data.decide(config.data_on_device, source, setup.decided.require_strategy()),
        ),
    )


def prepare_validation(setup: Setup, data: DataInput, batch_size: int | None) -> data_lib.Prepared:
    """Validation data prepared by the data layer and checked against what training built (not
    prepared as a second training input): the same per-example inputs, its targets checked
    against the objective and the model's outputs (every label of arrays), a batch the devices
    split, and the same on every process."""
    prepared = data_lib.prepare(data, batch_size=batch_size, needs_targets=not setup.custom_loss)
    prepared = capped_at_data(prepared, candidate_strategies(setup), 1, said=False)
    batches = prepared.source.steps(prepared.batch_size)
    facts: dict[str, JSON] = {"batch_size": prepared.batch_size, "inputs": str(prepared.spec), "rows": prepared.rows}
    distributed.check_same_configuration(
        {f"validation {name}": value for name, value in facts.items()} | {"validation batches": batches}
    )
    check_inputs(setup, prepared, other_lengths=True)  # as evaluate's
    if prepared.has_targets:
        setup.build_objective(prepared, every=True)
    data_lib.check_batch_size(prepared.batch_size, setup.decided.require_strategy().num_batch_shards)
    check_shared_rows(setup.decided.require_strategy(), prepared.source)
    return prepared


def check_shared_rows(strategy: Strategy, source: data_lib.Source) -> None:
    """Refuses an iterable on processes that share their rows (a stage axis across hosts): each
    process's iterable yields its own batches, which the strategy would take as the same rows."""
    share, processes = strategy.batch_share()[1], jax.process_count()
    if share == processes or data_lib.own_batch_size(source) is None:
        return
    raise ValueError(
        f"{strategy!r} on {processes} processes: the devices of several processes take the same rows (each batch "
        f"is {share} part(s), one per group of {processes // share} processes), and an iterable yields each process "
        "its own batches, which would be trained on as if they were the same rows. Pass arrays or a random-access "
        "source (the processes of a group then read the same part), or put the data axes across the processes."
    )
