"""``save_freq``: the one helper that validates Keras's ``"epoch"`` or a number of batches and
decides when a step-based save is due.

>>> every = SaveFrequency(3)
>>> [every.step_due(s) for s in range(0, 8)]
[False, False, False, True, False, False, True, False]
>>> every.step_due(8, since=4), every.step_due(8, since=6)  # executions of several steps
(True, False)
>>> SaveFrequency("epoch").per_epoch, SaveFrequency("epoch").step_due(3)
(True, False)
"""

from __future__ import annotations


class SaveFrequency:
    """``"epoch"`` (at every epoch end) or a positive number of batches.

    A step trigger fires at multiples of the global optimizer step, so a run resumed from a
    checkpoint fires where the uninterrupted run did.
    """

    def __init__(self, save_freq: str | int, who: str = "save_freq"):
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1):
            raise ValueError(
                f"Unrecognized save_freq: {save_freq!r}. Expected save_freq are 'epoch' or a positive integer "
                f"(a number of batches) for {who}."
            )
        self.value = save_freq
        self.period: int | None = None if isinstance(save_freq, str) else save_freq  # None: at epoch ends

    @property
    def per_epoch(self) -> bool:
        return self.period is None

    def step_due(self, step: int, since: int | None = None) -> bool:
        """Whether a multiple of the frequency lies in ``(since, step]`` (default: ``step``
        itself is one)."""
        since = step - 1 if since is None else since
        return self.period is not None and step > 0 and step // self.period > since // self.period
