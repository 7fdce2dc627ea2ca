"""``CarriedState``: how one ``fit`` carries the live state from one compiled call to the next.

A :class:`~trainkit.core.leaf_step.LeafStep` takes and returns the state's *carried leaves* (the
big leaves as they are, the small ones packed into one array: each buffer a call takes costs
XLA:CPU about 1.5 us). The fit keeps them here, as the last call returned them, and hands the
session only how to build the ``TrainState`` from them: it is built when something reads
``session.state`` (a callback, a checkpoint), never per step. A step of any other kind takes
the state itself, which the session holds.

>>> import jax.numpy as jnp
>>> from trainkit.core.leaf_step import LeafStep
>>> from trainkit.core.state import TrainState
>>> from trainkit.record.session import Session
>>> session = Session()
>>> session.replace_state(TrainState.create(params={"w": jnp.ones(40)}, opt_state=(), model_state={}, seed=0))
>>> step = LeafStep.jit(lambda s, n: (s.replace(step=s.step + 1), n), session.state, donate_state=False)
>>> call, read, keep = CarriedState(session).calls(step)
>>> leaves, _ = call(read(), 0); keep(leaves)
>>> read() is leaves, int(session.require_state().step), read() is leaves   # built once read; still carried
(True, 1, True)
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from trainkit.core.leaf_step import LeafStep
from trainkit.core.state import TrainState
from trainkit.core.tree import ArrayValue, PyTree, TreeFunction
from trainkit.record.session import Session


class CarriedState:
    """One ``fit``'s carried leaves on ``session``: those the last call of a
    :class:`~trainkit.core.leaf_step.LeafStep` returned (or the live state's, packed once), and
    that step. They stand for the session's state as long as the session holds no other
    (:meth:`Session.holds_unbuilt`): a state written meanwhile (``set_weights``, a restore) is
    packed afresh."""

    def __init__(self, session: Session):
        self.session = session
        self._held: tuple[list[ArrayValue], LeafStep] | None = None
        self._build: Callable[[], TrainState] = self._state  # one object: the session knows its own by identity

    def calls(self, train_fn: TreeFunction) -> tuple[TreeFunction, Callable[[], PyTree], Callable[[PyTree], None]]:
        """``(call, read, keep)`` for ``train_fn``: its call, the state as it takes it, and where
        the state it returned goes (the leaves here, else the session)."""
        if isinstance(train_fn, LeafStep):
            return train_fn.call_carried, lambda: self.leaves_for(train_fn), lambda leaves: self.keep(leaves, train_fn)
        return train_fn, self.session.require_state, self.session.stepped

    def leaves_for(self, step: LeafStep) -> list[ArrayValue]:
        """The live state as the carried leaves ``step`` takes: those held, when they are still
        the session's state and in ``step``'s layout (nothing built); else packed from the state."""
        held = self._held
        if held is not None and self.session.holds_unbuilt(self._build):
            if held[1] is step or held[1].carry.key() == step.carry.key():
                return held[0]
        state = self.session.require_state()
        carried = step.carried(jax.tree.leaves(state))
        self._held = (carried, step)
        self.session.stepped_unbuilt(self._build, built=state)
        return carried

    def keep(self, carried: list[ArrayValue], step: LeafStep) -> None:
        """The leaves a call of ``step`` returned are the live state now (built when read)."""
        self._held = (carried, step)
        self.session.stepped_unbuilt(self._build)

    def _state(self) -> TrainState:
        """The ``TrainState`` of the leaves held (what the session calls when its state is read)."""
        assert self._held is not None  # the session asks only after a keep or a pack
        carried, step = self._held
        state: TrainState = step.state(carried)
        return state
