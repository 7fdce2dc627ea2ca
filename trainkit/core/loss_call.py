"""Mistakes in a ``compute_loss`` of the user's, found while its step is traced (before the
first step), each of which trained on something else without a word:

- reading the live state (``self.state.params``) instead of the ``params`` argument: the live
  arrays are constants to the step, so the loss has no gradient and nothing learns;
- returning the ``model_state`` it was given after ``self.apply(..., train=True)`` returned an
  updated one: ``BatchNorm``'s statistics never move;
- calling ``self.apply(..., train=True)`` whatever ``train`` is: dropout stays on in
  ``evaluate`` and ``predict``'s figures are those of a training pass.

:func:`tracing` marks the call (the step's ``compute_loss``); the model's calls report to it
(:func:`applied`), and :func:`outside_a_step` guards the live state.

>>> with tracing(train=False, model_state={}) as call:
...     applied(train=True, given={}, returned={})
Traceback (most recent call last):
ValueError: compute_loss called self.apply(..., train=True) while the step evaluates (train=False): ...
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TypeVar

import jax

from trainkit.core.trace_context import current, under
from trainkit.core.tree import PyTree

T = TypeVar("T")


@dataclasses.dataclass
class LossCall:
    """One traced call of ``compute_loss``: in training or not, the model state it was given,
    and whether a training call of the model returned another one."""

    train: bool
    given: list[int]  # the ids of the model state's leaves it was given
    updated: bool = False


@contextlib.contextmanager
def tracing(train: bool, model_state: PyTree) -> Iterator[LossCall]:
    """While it lasts, ``compute_loss`` is being traced with ``train`` and ``model_state``."""
    call = LossCall(train, _ids(model_state))
    with under(call):  # a part of the step's trace context
        yield call


def applied(train: bool, given: PyTree, returned: PyTree) -> None:
    """The model was called (``self.apply``) inside the traced ``compute_loss`` with ``train``,
    given the model state ``given``, returning ``returned``; refuses a training call while the
    step evaluates."""
    call = current(LossCall)
    if call is None:
        return
    if train and not call.train:
        raise ValueError(
            "compute_loss called self.apply(..., train=True) while the step evaluates (train=False): dropout would "
            "stay on and batch statistics would be used as in training in evaluate and validation. Pass its train "
            "argument on: self.apply(params, model_state, batch['x'], rng=rng, train=train)."
        )
    if train and _ids(returned) != _ids(given):
        call.updated = True


def check_returned(call: LossCall, model_state: PyTree) -> None:
    """Refuses a training ``compute_loss`` that returned the model state it was given although
    the model's training call updated it."""
    if call.train and call.updated and call.given and _ids(model_state) == call.given:
        raise ValueError(
            "compute_loss returned the model_state it was given, not the one self.apply(..., train=True) returned: "
            "the model's state (BatchNorm's statistics) would never update. Return the new one: "
            "outputs, model_state = self.apply(...); return loss, (outputs, model_state)."
        )


def _ids(tree: PyTree) -> list[int]:
    """The identities of ``tree``'s leaves (tracers: the same value passed on, or a new one)."""
    return [id(leaf) for leaf in jax.tree.leaves(tree)]


def outside_a_step(state: T) -> T:
    """``state`` (the live state) unless a ``compute_loss`` is being traced, where reading it is
    the mistake of using the live parameters instead of the ``params`` argument."""
    if current(LossCall) is not None:
        raise ValueError(
            "compute_loss read trainer.state (the live state) while its step is traced: those arrays are "
            "constants to the step, so the loss would have no gradient and nothing would learn. Use the params "
            "and model_state arguments compute_loss is given."
        )
    return state
