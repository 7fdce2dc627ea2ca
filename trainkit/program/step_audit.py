"""A ``train_step`` of the user's own audited before its first update, on up to
``CHECKED_ROWS`` rows of the first batch (compiled once, under ``jit`` semantics, from the live
state; nothing kept), for the mistakes no trace can see:

- a group updated on gradients that are all zero (``state.apply_gradients(grads,
  group="generator")`` with the critic's gradients: the loss never reads the generator, and Adam
  would still move it) is refused naming the group;
- where the data pads a partial last batch (or its length is unknown), the step is run twice with
  different contents in one row marked padded, as the last batch pads it: a log or a parameter
  that moves counted the padded row (a ``jnp.mean`` over the batch instead of
  ``state.mean(values, batch)``), and the fit is refused naming the fix;
- under a strategy with a device axis (``DataParallel``: each device runs the step on its own
  rows), the step is run as the devices run it (a ``vmap`` over them, the model in inference
  mode on both sides: dropout's masks differ per device by design) and as one device does: logs
  that differ drew or mixed over each device's rows (``jax.random.permutation(rng, len(x))``,
  ``jax.random.normal(rng, (rows, ...))``, the same on every device), and the fit is refused
  naming ``state.shuffled`` / ``state.normal`` / ``state.all_rows``.

Audited once per step value, at the first ``fit`` that runs it (a trainer's override: once; a
``tk.Step`` replaced by another value: again). Under a strategy with a device axis every run of
the audit is under that axis (a ``vmap`` of one device where the rows are not split), so a step
that names the axis itself (``lax.psum(x, "data")``) is audited as it trains.
"""

from __future__ import annotations

import jax
import numpy as np

from trainkit import data as data_lib
from trainkit.core.checks import SettingError
from trainkit.core.state import Batch, TrainState
from trainkit.core.tree import PyTree, TreeFunction
from trainkit.program.program import Program
from trainkit.strategies import Strategy

#: the rows of the first batch the audit runs the step on
CHECKED_ROWS = 32


def audit_own_step(program: Program, state: TrainState, strategy: Strategy, prepared: data_lib.Prepared) -> None:
    """Refuses a custom ``train_step`` of ``program`` (run from the live ``state``, split as
    ``strategy`` splits a batch) that updates a group on all-zero gradients, or whose logs or
    update move with a padded row's content or with the rows' split over the devices."""
    if not program.steps.own.audit_due() or jax.process_count() > 1:
        return
    program.steps.own.audited()
    batch = prepared.sample_batch()
    rows = min(CHECKED_ROWS, int(np.sum(batch["mask"])))
    if rows < 3:
        return
    updates: list[tuple[str, bool]] = []  # (group, all its gradients zero) of each update, as the step runs
    step = _on_one_device(program.steps.audited_train_step(updates, strategy.axis_name), strategy.axis_name)
    small = data_lib.take(batch, slice(0, rows))
    jax.block_until_ready(step(state, small))
    jax.effects_barrier()  # every update's callback has run
    zero: dict[str, bool] = {}
    for group, flag in updates:  # any of a group's updates (each pass of a loop around one)
        zero[group] = zero.get(group, False) or flag
    closure = (
        "a loss function that reads state.params (or a variable from outside) instead of the parameters it is "
        "given: jax.grad(loss)(state.params) differentiates only what loss computes from its argument, so "
        "def loss(params): model(state.params, ...) has zero gradients. Compute the loss from the argument"
    )
    for group, flag in zero.items():
        if not bool(flag):
            continue
        if group == "the parameters":  # no optimizer groups: group= is not the fix
            raise SettingError(
                f"train_step updates the parameters on gradients that are all zero on the first batch: the loss "
                f"they are the gradients of does not depend on them. Most often {closure}: "
                "def loss(params): model(params, ...). Where zero gradients are meant (a warm-up), say so: "
                "state.apply_gradients(grads, allow_zero_gradients=True)."
            )
        raise SettingError(
            f"train_step updates {group!r} on gradients that are all zero on the first batch: the loss they are "
            f"the gradients of never reads {group!r}'s parameters (a loss of another group's, or its group= "
            "left out), and the optimizer would still move them (Adam's moments). Pass the gradients of the "
            "loss that trains it, with its own group: state.apply_gradients(grads, group='<the group it trains>'). "
            f"Or {closure}. Where zero gradients are meant (a warm-up, a zero-initialised head), say so: "
            f"state.apply_gradients(grads, group={group!r}, allow_zero_gradients=True)."
        )
    pads = prepared.rows is None or prepared.rows % prepared.batch_size != 0
    if pads and not jax.tree.leaves(state.model_state):  # batch statistics see padded rows in any step, by design
        _check_padded_rows(step, state, small, prepared)
    if strategy.axis_name is not None and not jax.tree.leaves(state.model_state):  # per-device statistics: by design
        _check_device_split(program, state, small, strategy.axis_name, len(strategy.devices))


def _on_one_device(step: TreeFunction, axis: str | None) -> TreeFunction:
    """``step`` (``(state, batch) -> outputs``) compiled as one device runs it: under the device
    ``axis`` when the strategy has one (a ``vmap`` of one, the whole batch on it), so that a step
    naming the axis itself traces; the outputs as one device's."""
    if axis is None:
        return jax.jit(step)
    one = jax.vmap(step, in_axes=(None, 0), axis_name=axis)

    def on_one(state: PyTree, batch: Batch) -> PyTree:
        return jax.tree.map(lambda a: a[0], one(state, jax.tree.map(lambda a: a[None], batch)))

    return jax.jit(on_one)


def _check_padded_rows(step: TreeFunction, state: TrainState, small: Batch, prepared: data_lib.Prepared) -> None:
    rows = len(small["mask"])
    mask = np.asarray(small["mask"]).copy()
    mask[-1] = 0  # the last row pads
    variants = [{**data_lib.take(small, np.r_[0 : rows - 1, source]), "mask": mask} for source in (0, 1)]
    (first, first_logs), (second, second_logs) = (step(state, variant) for variant in variants)
    for what, a, b in (("logs", first_logs, second_logs), ("update", first.params, second.params)):
        if not all(np.allclose(x, y, rtol=1e-6, atol=1e-7) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))):
            rows_said = "" if prepared.rows is None else f" ({prepared.rows} rows in batches of {prepared.batch_size})"
            raise SettingError(
                f"train_step's {what} moved when only a padded row changed: the step counts the rows that pad a "
                f"partial last batch{rows_said}, e.g. with jnp.mean(per_row) over the batch. Reduce per-row values "
                "with state.mean(values, batch), which leaves the padded rows out (batch['mask'] marks them), or "
                "pass a batch_size that divides the data."
            )


def _check_device_split(program: Program, state: TrainState, small: Batch, axis: str, devices: int) -> None:
    """Refuses a step whose logs on the first batch differ when its rows are split over ``devices``
    (as the strategy's axis splits them) from one device's: a draw or a mix over each device's rows."""
    rows = (len(small["mask"]) // devices) * devices
    if rows < 2 * devices or not np.all(np.asarray(small["mask"])[:rows]):
        return
    whole = data_lib.take(small, slice(0, rows))
    split = jax.tree.map(lambda a: np.asarray(a).reshape(devices, rows // devices, *np.shape(a)[1:]), whole)
    one = _on_one_device(program.steps.audited_train_step(None, axis, inference=True), axis)
    spread = jax.jit(jax.vmap(program.steps.audited_train_step(None, axis, inference=True), (None, 0), axis_name=axis))
    (_, logs), (_, spread_logs) = one(state, whole), spread(state, split)
    found = {name: (float(logs[name].compute()), float(spread_logs[name].compute()[0])) for name in logs}
    apart = {name: pair for name, pair in found.items() if not np.isclose(*pair, rtol=1e-4, atol=1e-6)}
    if apart:
        name, (alone, spread_out) = next(iter(apart.items()))
        raise SettingError(
            f"train_step's {name!r} on the first batch is {spread_out:.6g} when its rows are split over the "
            f"{devices} devices of the strategy's {axis!r} axis and {alone:.6g} on one device: each device runs the "
            "step on its own rows, so a draw or a mix over the batch is over those rows alone "
            "(jax.random.permutation(rng, len(x)): partners from the same device only; jax.random.normal(rng, "
            "(rows, ...)): the same draws on every device). Draw partners with state.shuffled(values, rng, batch) "
            "(one permutation of the global batch), per-row noise with state.normal(rng, batch, shape), and reach "
            "other rows with state.all_rows(values); or train with tk.FSDP() or tk.Hybrid(...), whose step sees the "
            "global batch."
        )
