"""``TerminateOnNaN``: stop (or raise) at the first non-finite loss (or logged gradient norm), before
another update.

>>> TerminateOnNaN(raise_error=True).raise_error
True
"""

from __future__ import annotations

import math

from trainkit.callbacks.base import Callback, Logs
from trainkit.core.totals import GRAD_NORM
from trainkit.core.warn import warn_user
from trainkit.loop import first_non_finite


class TerminateOnNaN(Callback):
    """Stops training when the loss becomes NaN or infinite (Keras 3's callback), or, with
    ``Trainer(log_grad_norm=True)``, the gradient norm does (a NaN gradient behind a finite loss,
    which Keras sees one step later, in the next loss).

    It is not ``async_safe``: the loop runs each batch's hooks before dispatching the next, so
    no update reaches the parameters after the non-finite batch (whose own update is applied,
    as in Keras). ``raise_error=True`` raises a ``RuntimeError`` instead of stopping, which
    skips ``on_train_end`` of every callback (backups are kept). ``stopped_step`` names the
    optimizer step (counting from 1).
    """

    stops_on_non_finite = True

    def __init__(self, raise_error: bool = False):
        self.raise_error = raise_error
        self.stopped_step: int | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self.stopped_step = None

    def on_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        loss, norm = (logs or {}).get("loss"), (logs or {}).get(GRAD_NORM)
        finite = all(value is None or math.isfinite(value) for value in (loss, norm))
        if finite or self.stopped_step is not None:
            return
        record = self.session.require_record()
        step = record.step
        if record.steps > 1:  # one hook for several steps: name the first that went wrong
            step, batch, loss = first_non_finite(self.session) or (step, batch, loss)
        self.stopped_step = step
        where = f"batch {batch} of epoch {record.epoch} (step {step}, counting from 1)"
        if loss is not None and not math.isfinite(loss):
            what, said = f"NaN or Inf loss encountered at {where}. Loss value: {loss}", f"the loss became {loss}"
        else:  # the logged gradient norm went first, behind a finite loss
            what = f"NaN or Inf gradient encountered at {where} (its loss, {loss}, is finite). Gradient norm: {norm}"
            said = f"the gradient became {norm} (its loss, {loss}, is finite)"
        if self.raise_error:
            raise RuntimeError(f"{what}. Terminating training.")
        warn_user(f"TerminateOnNaN: {said} at {where}; stopping training.")
        self.model.stop_training = True
