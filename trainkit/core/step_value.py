"""A train step as a value (#82): ``tk.Step``, a frozen dataclass whose fields are its
hyperparameters and whose ``train(state, batch, rng) -> (state, logs)`` (and, where it
evaluates in its own way, ``test(state, batch, rng) -> logs``) every strategy compiles, fuses
and resumes as it does the built-in step. ``Trainer(model, optimizer=..., step=GAN(...))``.

- A hyperparameter changed between fits is a new value (``trainer.step =
  dataclasses.replace(trainer.step, beta=0.5)``): the trainer traces the step again with it.
- A step cannot keep a value of one trace on itself: it is frozen, and the dataclass's own
  ``FrozenInstanceError`` becomes trainkit's error naming the fix (:func:`frozen_while_traced`).

>>> import dataclasses, jax
>>> @dataclasses.dataclass(frozen=True)
... class Regression(Step):
...     scale: float = 1.0
...     def train(self, state, batch, rng):
...         rows = lambda params: (self.scale * batch["x"] * params["w"] - batch["y"]) ** 2
...         loss, grads = jax.value_and_grad(lambda p: state.mean(rows(p), batch))(state.params)
...         return state.apply_gradients(grads), {"loss": loss}
>>> step = checked_step(Regression(scale=2.0))
>>> step.trains, step.tests, step.watched()
(True, False, {'scale': 2.0})
>>> changed(step.watched(), dataclasses.replace(step, scale=0.5).watched())
['scale: 2.0 -> 0.5']
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from typing import ClassVar, Protocol

import clu.metrics
import jax
import numpy as np

from trainkit.core.checks import SettingError
from trainkit.core.custom_step import make_custom_eval_step, make_custom_train_step
from trainkit.core.state import Batch, TrainState
from trainkit.core.step_state import StepFacts, StepState

#: a step as every strategy compiles it: ``(state, batch) -> (state, metrics)``, each metric a
#: :mod:`clu.metrics` state of the step's real rows (merged into the epoch's totals)
TrainMetricsStep = Callable[[TrainState, Batch], tuple[TrainState, Mapping[str, clu.metrics.Metric]]]
#: an evaluation as every strategy compiles it: ``(state, batch) -> metrics``
EvalMetricsStep = Callable[[TrainState, Batch], Mapping[str, clu.metrics.Metric]]

_PLAIN = (bool, int, float, complex, str, bytes, type(None), np.generic)


def is_plain(value: object) -> bool:
    """A value a step may read as a constant of its trace: a number of any kind (a NumPy or JAX
    scalar, a 0-d array included), a string, ``None``, or a tuple of them."""
    if isinstance(value, tuple):
        return all(is_plain(v) for v in value)
    return isinstance(value, _PLAIN) or _scalar_array(value)


def _scalar_array(value: object) -> bool:
    return isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0


def as_read(value: object) -> object:
    """``value`` as a trace reads it: the number of a 0-d array (which may be written in place),
    a tuple of such, anything else itself."""
    if isinstance(value, tuple):
        return tuple(as_read(v) for v in value)
    return np.asarray(value).item() if _scalar_array(value) or isinstance(value, np.generic) else value


def _same(a: object, b: object) -> bool:
    if isinstance(a, (np.ndarray, jax.Array)) or isinstance(b, (np.ndarray, jax.Array)):
        first, second = np.asarray(a), np.asarray(b)
        return first.shape == second.shape and bool(np.array_equal(first, second))
    return bool(a == b)


def changed(traced: Mapping[str, object], now: Mapping[str, object]) -> list[str]:
    """``'name: old -> new'`` for each value of ``traced`` that ``now`` holds otherwise (or not at all)."""
    missing = object()
    return [
        f"{name}: {value!r} -> {now.get(name)!r}"
        for name, value in traced.items()
        if not _same(value, now.get(name, missing))
    ]


class _DataclassParams(Protocol):
    frozen: bool


class Step:
    """A train step of your own, as a frozen dataclass (``@dataclasses.dataclass(frozen=True)``)
    whose fields are its hyperparameters: override :meth:`train`, and :meth:`test` to evaluate in
    a way of your own (default: by ``loss=``). The helpers live on the state it threads
    (``state.apply``, ``state.apply_gradients(grads, group)``, ``state.mean``, ``state.normal``,
    ``state.all_rows``; docs/custom_training.md)."""

    __dataclass_params__: ClassVar[_DataclassParams]  # set by @dataclasses.dataclass

    def train(self, state: StepState, batch: Batch, rng: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        """``(state, batch, rng) -> (state, logs)``: the new state (``state.apply_gradients``'s)
        and a dict of scalar logs."""
        raise NotImplementedError(f"{type(self).__name__} is a tk.Step with no train(self, state, batch, rng).")

    def test(self, state: StepState, batch: Batch, rng: jax.Array) -> dict[str, jax.Array]:
        """``(state, batch, rng) -> logs``: an evaluation of its own."""
        raise NotImplementedError(
            "evaluate and validation run the step's test(state, batch, rng) -> logs, and this step has none and the "
            "trainer no loss= for the built-in evaluation: define test (e.g. return {'d_loss': state.mean(per_row, "
            "batch)}), or pass loss=... ."
        )

    def train_metrics(self, facts: StepFacts) -> TrainMetricsStep:
        """The step as every strategy compiles it (under ``facts``: the device axis, the optimizer,
        its groups): :meth:`train` with its ``rng`` the state's folded with the step number, its
        returned state checked and its logs weighted by the real rows
        (:func:`~trainkit.core.custom_step.make_custom_train_step`). The built-in step
        (:class:`~trainkit.core.loss_step.LossStep`) compiles its own loss step here instead. trainkit's
        seam, not an extension point: a value given as ``step=`` is compiled through its ``train``."""
        return make_custom_train_step(self.train, facts)

    def test_metrics(self, facts: StepFacts) -> EvalMetricsStep:
        """The evaluation as every strategy compiles it: :meth:`test`, its logs weighted by the real rows."""
        return make_custom_eval_step(self.test, facts)

    @property
    def trains(self) -> bool:
        """It replaces the built-in train step (declared by defining :meth:`train`)."""
        return type(self).train is not Step.train

    @property
    def tests(self) -> bool:
        """It replaces the built-in evaluation (declared by defining :meth:`test`)."""
        return type(self).test is not Step.test

    def traced_values(self) -> dict[str, object]:
        """The values a trace of this step was built from (read after it is traced)."""
        return self.watched()

    def watched(self) -> dict[str, object]:
        """The values a trace of this step is built from, as read now: its fields."""
        if not dataclasses.is_dataclass(self) or isinstance(self, type):
            return {}
        values = zip(dataclasses.fields(self), dataclasses.astuple(self))
        return {field.name: as_read(value) for field, value in values if field.compare}


def checked_step(step: object) -> Step:
    """``step`` as ``Trainer(step=...)`` takes it: a ``tk.Step`` subclass declared a frozen
    dataclass that defines ``train``; anything else refused naming the fix."""
    if not isinstance(step, Step):
        raise TypeError(
            f"step= takes a tk.Step (a frozen dataclass with train(self, state, batch, rng)); received "
            f"{type(step).__name__}. A function of your own: override Trainer.train_step instead."
        )
    name = type(step).__name__
    if not (dataclasses.is_dataclass(step) and type(step).__dataclass_params__.frozen):
        raise TypeError(
            f"{name} is a tk.Step but not a frozen dataclass: declare it @dataclasses.dataclass(frozen=True), so its "
            "fields are its hyperparameters, a changed one is a new value (traced again), and nothing a trace "
            "computes can be kept on it."
        )
    if not step.trains:
        raise TypeError(f"{name} defines no train(self, state, batch, rng) -> (state, logs): the step it is.")
    return step


@contextlib.contextmanager
def frozen_while_traced(where: str) -> Iterator[None]:
    """Around one trace of the step ``where`` (``"train_step"``): an attribute it sets on itself
    (a frozen value) refused naming the fix."""
    try:
        yield
    except dataclasses.FrozenInstanceError as error:
        found = re.search(r"'([^']+)'", str(error))
        name = found.group(1) if found else "an attribute"
        raise SettingError(
            f"{where} set self.{name} while trainkit traced it: the step runs compiled, so the attribute would hold "
            "a tracer of that one trace (reading it later fails), never a value of a step. Return the value in the "
            "logs (return state, {'d_loss': d_loss}) and read it from a callback's logs or History, or keep state "
            "that must carry over (an EMA target, a queue) in the state (docs/custom_training.md, 'State of your "
            "own')."
        ) from None
