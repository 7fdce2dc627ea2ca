"""A ``train_step`` of the user's own never counts the rows that pad a partial batch: the step
is run (compiled once, on up to ``CHECKED_ROWS`` rows of the first batch, one of them marked
padded) with two different contents in that padded row, as the data's last batch would pad
it; a log or a parameter that moves between the two counted the padded row (a ``jnp.mean`` over
the batch instead of ``state.mean(values, batch)``), and the fit is refused naming the fix.
Checked once per trainer, at the first ``fit`` whose data pads (or whose length is unknown).
"""

from __future__ import annotations

import jax
import numpy as np

from trainkit import data as data_lib
from trainkit.core.checks import SettingError
from trainkit.program.setup import Setup

#: the rows of the first batch the check runs the step on
CHECKED_ROWS = 32


def check_padded_rows(setup: Setup, prepared: data_lib.Prepared) -> None:
    """Refuses a custom ``train_step`` whose logs or update move with a padded row's content."""
    program, size = setup.program, prepared.batch_size
    if program.train_step is None or setup.checked_padding or jax.process_count() > 1:
        return
    if prepared.rows is not None and prepared.rows % size == 0:
        return  # no batch pads
    state = setup.session.require_state()
    setup.checked_padding = True
    if jax.tree.leaves(state.model_state):
        return  # batch statistics see every row the model runs on, padded ones too, in any step
    batch = prepared.sample_batch()
    rows = min(CHECKED_ROWS, int(np.sum(batch["mask"])))
    if rows < 3:
        return
    small = data_lib.take(batch, slice(0, rows))
    small["mask"] = np.asarray(small["mask"]).copy()
    small["mask"][-1] = 0  # the last row pads
    variants = [data_lib.take(small, np.r_[0 : rows - 1, source]) for source in (0, 1)]  # padded as a copy
    for variant in variants:
        variant["mask"] = small["mask"]
    step = jax.jit(program.metrics_step("train", None))
    (first, first_logs), (second, second_logs) = (step(state, variant) for variant in variants)
    for what, a, b in (("logs", first_logs, second_logs), ("update", first.params, second.params)):
        if not all(np.allclose(x, y, rtol=1e-6, atol=1e-7) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))):
            pads = "" if prepared.rows is None else f" ({prepared.rows} rows in batches of {size} pad the last one)"
            raise SettingError(
                f"train_step's {what} moved when only a padded row changed: the step counts the rows that pad a "
                f"partial last batch{pads}, e.g. with jnp.mean(per_row) over the batch. Reduce per-row values with "
                "state.mean(values, batch), which leaves the padded rows out (batch['mask'] marks them), or pass a "
                "batch_size that divides the data."
            )
