"""The frozen ``FitConfig`` of one ``fit`` (Keras's arguments, checked before anything runs) and
its ``Validation`` data; here, where both the setup (``program``) and the ``loop`` may import it.

>>> config = FitConfig(epochs=3, validation_freq=2).checked()
>>> config.epochs, config.validates(1), config.validates(2)
(3, True, False)
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from trainkit.core.tree import JSON
from trainkit.data.batching import check_positive, check_shuffle
from trainkit.data.epochs import epochs_until
from trainkit.data.source import Source


class Validation(NamedTuple):
    """The validation data of a ``fit``: its source, global batch size and Keras's
    ``validation_steps``."""

    source: Source
    batch_size: int
    steps: int | None = None


def validates(epoch: int, validation_freq: int | list[int]) -> bool:
    """Keras's ``validation_freq``: whether epoch ``epoch`` (from 0) ends with validation.

    >>> [validates(e, 2) for e in range(4)], [validates(e, [1, 4]) for e in range(4)]
    ([False, True, False, True], [True, False, False, True])
    """
    if isinstance(validation_freq, int) and not isinstance(validation_freq, bool) and validation_freq >= 1:
        return (epoch + 1) % validation_freq == 0
    if isinstance(validation_freq, (list, tuple)):
        return epoch + 1 in validation_freq
    raise ValueError(
        "validation_freq must be a positive integer or a list of epochs (counted from 1); "
        f"received {validation_freq!r}."
    )


@dataclasses.dataclass(frozen=True)
class FitConfig:
    """The settings of one ``fit``.

    ``epochs``: ``None`` (with ``max_steps``) until ``max_steps``, resolved once the data is
    prepared (:meth:`until_max_steps`); ``steps``: batches per epoch (``None``: until the data
    ends); ``validation`` is evaluated
    after the epochs ``validation_freq`` names, or with ``validation_interval`` after every that
    many optimizer steps; ``continuing``: epochs walk on through the data (Keras's ``steps_per_epoch`` on arrays);
    ``warn_non_finite``: warn once per epoch when the loss is not finite; ``read_ahead``: data
    may be read in a background thread (``False``: every element in the thread that calls ``fit``);
    ``data_on_device``: in-memory arrays kept on the devices, a fused call gathering its rows
    there (``"auto"``, ``True`` or ``False``; resolved to a bool once the data is prepared:
    :mod:`trainkit.program.device_data`).
    """

    epochs: int | None = 1
    initial_epoch: int = 0
    steps: int | None = None
    steps_per_epoch: int | None = None
    max_steps: int | None = None
    shuffle: bool | str = True
    seed: int = 0
    validation: Validation | None = None
    validation_freq: int | list[int] = 1
    validation_interval: int | None = None
    validation_steps: int | None = None
    warn_non_finite: bool = True
    continuing: bool = False
    read_ahead: bool = True
    data_on_device: bool | str = "auto"

    def checked(self, *, has_validation: bool = False) -> FitConfig:
        """This config from ``fit``'s arguments, each refused with a clear error before anything
        runs (``has_validation``: validation data was given), ``epochs=None`` without
        ``max_steps`` read as Keras's one epoch."""
        config = self
        if config.epochs is None and config.max_steps is None:  # Keras's default: one epoch
            config = dataclasses.replace(config, epochs=1)
        check_positive(
            epochs=1 if config.epochs is None else config.epochs,
            steps_per_epoch=config.steps_per_epoch,
            max_steps=config.max_steps,
            validation_interval=config.validation_interval,
        )
        if has_validation:
            check_positive(validation_steps=config.validation_steps)
        if config.validation_interval is not None and not has_validation:
            raise ValueError(
                f"validation_interval={config.validation_interval} needs validation_data (or validation_split): "
                "there is nothing to validate on."
            )
        validates(0, config.validation_freq)
        check_shuffle(config.shuffle)
        if not isinstance(config.data_on_device, bool) and config.data_on_device != "auto":
            raise ValueError(f"data_on_device must be 'auto', True or False; received {config.data_on_device!r}.")
        return config

    @property
    def epoch_count(self) -> int:
        """``epochs``, once known (:meth:`until_max_steps` sets it for ``epochs=None``)."""
        if self.epochs is None:
            raise RuntimeError("epochs=None is resolved from max_steps once the data is prepared.")
        return self.epochs

    def until_max_steps(self, steps: int | None, one_shot: bool) -> FitConfig:
        """This config with ``epochs=None`` resolved: enough epochs of ``steps`` batches to reach
        ``max_steps`` (:func:`~trainkit.data.epochs.epochs_until`)."""
        if self.epochs is not None or self.max_steps is None:
            return self
        return dataclasses.replace(self, epochs=epochs_until(self.max_steps, steps, one_shot))

    def planned_steps(self, steps: int | None) -> int | None:
        """The steps this fit trains at most, with ``steps`` batches per epoch: its epochs (from
        ``initial_epoch``) capped by ``max_steps``; ``None`` when unknown.

        >>> FitConfig(epochs=3, initial_epoch=1).planned_steps(10), FitConfig(None, max_steps=5).planned_steps(None)
        (20, 5)
        """
        epochs = None if self.epochs is None else max(0, self.epochs - self.initial_epoch)
        total = None if steps is None or epochs is None else steps * epochs
        if self.max_steps is not None:
            total = self.max_steps if total is None else min(total, self.max_steps)
        return total

    def validates(self, epoch: int) -> bool:
        return validates(epoch, self.validation_freq)

    def validation_runs(self) -> int:
        """How many times this fit validates (for a one-shot iterator as validation data)."""
        if self.validation_interval:
            return (self.max_steps or 2 * self.validation_interval) // self.validation_interval
        return sum(self.validates(e) for e in range(self.initial_epoch, self.epoch_count))

    def loop_settings(self) -> dict[str, JSON]:
        """What every process must agree on (checked across processes)."""
        return {
            "epochs": self.epochs,
            "shuffle": self.shuffle,
            "steps_per_epoch": self.steps_per_epoch,
            "max_steps": self.max_steps,
            "initial_epoch": self.initial_epoch,
        }
