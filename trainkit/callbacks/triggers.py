"""``Every``: the one helper that decides "every N steps / every N epochs" for callbacks.

>>> every = Every(steps=3)
>>> [every.step_due(s) for s in range(0, 8)]
[False, False, False, True, False, False, True, False]
>>> Every(epochs=2).epoch_due(1), Every(epochs=2).epoch_due(2)
(True, False)
"""

from __future__ import annotations


class Every:
    """Fires every ``steps`` optimizer steps and/or at the end of every ``epochs``-th epoch.

    Steps are global optimizer steps: a step trigger fires at multiples of ``steps``, so a
    run resumed from a checkpoint fires where the uninterrupted run did. Check it where the
    live state *is* that step (``on_train_batch_begin``: the steps done before the next batch).
    """

    def __init__(self, steps: int | None = None, epochs: int | None = None):
        for name, value in (("steps", steps), ("epochs", epochs)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"every_n_{name} must be a positive integer or None; received {value!r}.")
        self.steps, self.epochs = steps, epochs

    def step_due(self, step: int) -> bool:
        return self.steps is not None and step > 0 and step % self.steps == 0

    def epoch_due(self, epoch: int) -> bool:
        """``epoch`` counts from 0: the end of epoch ``epoch``."""
        return self.epochs is not None and (epoch + 1) % self.epochs == 0
