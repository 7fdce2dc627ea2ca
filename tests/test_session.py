"""The one holder of a run's state: ``trainkit.record.session.Session``. Its values are read-only
from outside, change only through its methods, and come back whole from a snapshot; the trainer,
the loop, the setup and the callbacks all see the same one."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import trainkit as tk
from trainkit.core.leaf_step import Carry, LeafStep
from trainkit.core.state import TrainState
from trainkit.loop.carried import CarriedState
from trainkit.record.session import FitView, Position, Session, Snapshot, StepRecord


def test_a_snapshot_holds_every_value_of_the_session():
    fields = {field.name for field in dataclasses.fields(Snapshot)}
    # the fields are listed once, in Snapshot: the session holds them in one frozen value (``_now``)
    # and, for those a step or a signal handler writes, in slots of the same names; nothing else is
    # held (``_unbuilt`` builds the state a fit holds as carried leaves: a snapshot holds it built, as
    # ``state``; ``_ledger`` is the clock of the running fit's goodput ledger, which a trial fit's
    # restore leaves running)
    assert {name[1:] for name in Session.__slots__} - {"now", "unbuilt", "ledger"} <= fields
    # and restore() puts back every field, wherever it is held
    values = Snapshot(
        position=Position(1, 2, 9), record=StepRecord(step=9, epoch=1, batch=1), epoch_start=Position(1, 0, 8),
        data_state={"read": 3}, resume_state=[2], start=Position(1, 0, 8), stop_requested=True, preempted=True,
        fit=FitView(16, ("loss",)), batch_spec={"x": 1}, validating_at=5, history="history",
    )  # fmt: skip
    assert set(vars(values)) == fields  # every field given a value of its own above (state and carry: None)
    session = Session()
    session.restore(values)
    assert session.snapshot() == values


def test_a_state_kept_as_carried_leaves_is_built_when_read_and_snapshotted_whole():
    session = Session()
    state = TrainState.create(params={"w": jnp.ones(40)}, opt_state=(), model_state={}, seed=0)
    step = LeafStep.jit(lambda s, totals: (s.replace(step=s.step + 1), totals), state, donate_state=False)
    assert step.carry.small == (0, 2)  # the step counter and the rng travel packed, w as it is
    session.replace_state(state)
    fit_state = CarriedState(session)  # the fit's carried leaves (loop/carried.py), not the session's
    carried, _ = step.call_carried(fit_state.leaves_for(step), 0)
    fit_state.keep(carried, step)
    assert fit_state.leaves_for(step) is carried  # as they are, nothing built
    snapshot = session.snapshot()
    assert isinstance(snapshot.state, TrainState) and int(snapshot.state.step) == 1
    assert session.state is snapshot.state  # built once
    assert fit_state.leaves_for(step) is carried  # and still carried as they were
    np.testing.assert_array_equal(snapshot.state.rng, state.rng)
    fit_state.keep(step.carried(jax.tree.leaves(state)), step)
    session.restore(snapshot)
    assert int(session.require_state().step) == 1
    assert fit_state.leaves_for(step) is not carried  # a state written since is packed afresh


def test_the_session_is_read_only_outside_its_methods():
    session = Session()
    for name in ("state", "position", "record", "stop_requested", "batch_size"):
        with pytest.raises(AttributeError):
            setattr(session, name, None)
    with pytest.raises(AttributeError):
        session.anything_else = 1  # slots: no attribute can be hung on it


def test_snapshot_and_restore_round_trip_every_value():
    session = Session()
    session.begin_fit(FitView(batch_size=16, logged_names=("loss",)), Position(2, 0, 7))
    session.resume_at(Position(2, 3, 9), saved_batch_size=16, data_state=[{"at": 3}])
    session.about(StepRecord(step=10, epoch=2, batch=1))
    session.request_stop()
    saved = session.snapshot()
    session.begin_fit(FitView(), Position())
    session.preempt()
    assert session.snapshot() != saved
    session.restore(saved)
    assert session.snapshot() == saved
    assert session.start == Position(2, 3, 9)
    assert (session.position.step, session.resume_state, session.stop_requested, session.preempted) == (
        9,
        {"at": 3},
        True,
        False,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        saved.position = Position()  # type: ignore[misc]
    with pytest.warns(UserWarning, match="The iterator restarts"):  # another batch size: by examples seen
        session.resume_at(Position(2, 3, 9), saved_batch_size=8, data_state=[{"at": 3}])
    assert session.start == Position(2, 1, 9) and session.resume_state is None


def test_a_restore_moves_the_step_and_a_weights_edit_does_not():
    import jax.numpy as jnp

    state = tk.TrainState.create(params={"w": jnp.zeros(2)}, opt_state=(), model_state={}, seed=0)
    session = Session()
    session.replace_state(state.replace(step=jnp.asarray(5, jnp.int32)))
    assert session.position.step == 5
    session.replace_state(state, moves_position=False)
    assert session.position.step == 5 and int(session.require_state().step) == 0


def test_trainer_loop_setup_and_callbacks_share_one_session():
    x = np.random.default_rng(0).normal(size=(32, 3)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    seen = []

    class Watch(tk.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((self.session is self.model.session, self.session.require_record().step))

    trainer = tk.Trainer(_mlp(), **_args())
    assert trainer.loop.session is trainer.session is trainer.setup.session
    trainer.fit((x, y), batch_size=8, epochs=1, verbose=0, callbacks=[Watch()])
    assert seen == [(True, 1), (True, 2), (True, 3), (True, 4)]
    assert trainer.global_step == trainer.session.position.step == 4
    assert trainer.state is trainer.session.state


def test_a_trial_fit_puts_the_session_and_the_decisions_back():
    x = np.random.default_rng(1).normal(size=(64, 3)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    trainer = tk.Trainer(_mlp(), **_args())
    trainer.fit((x, y), batch_size=16, epochs=1, verbose=0)
    before, decisions = trainer.session.snapshot(), trainer.setup.decided.value
    host = jax.tree.map(np.asarray, jax.device_get(trainer.state))
    trainer.find_learning_rate(x, y, batch_size=16, steps=5)
    after = trainer.session.snapshot()
    assert dataclasses.replace(after, state=None) == dataclasses.replace(before, state=None)
    assert trainer.setup.decided.value == decisions
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(jax.device_get(trainer.state))):
        np.testing.assert_array_equal(a, b)


def _mlp():
    import flax.linen as nn

    return nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)])


def _args():
    return {
        "loss": "sparse_categorical_crossentropy",
        "optimizer": optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
        "strategy": "single",
    }


def test_only_small_replicated_counters_and_keys_travel_packed():
    """``Carry`` packs replicated leaves of at most 2 elements of 32 bits (the step, a raw key,
    Adam's count, a loss scale); never a sharded leaf, a parameter-sized one, a typed key, a
    weak-typed value (rebuilt strong it would trace a new program) or a 64/16-bit one."""
    leaves = [
        jnp.zeros((), jnp.int32),  # 0: a counter
        jax.random.PRNGKey(0),  # 1: a raw key
        jnp.ones(3),  # 2: too big
        jnp.float32(2.0),  # 3: a float scalar
        jax.random.key(0),  # 4: a typed key
        jnp.asarray(1.0),  # 5: weak-typed
        jnp.zeros((), jnp.bfloat16),  # 6: 16 bits
        jnp.zeros((), jnp.int32),  # 7: sharded (not replicated)
    ]
    carry = Carry(leaves, [True] * 7 + [False])
    assert carry.small == (0, 1, 3) and carry.big == (2, 4, 5, 6, 7)
    values = [np.int32(7), np.array([3, 4], np.uint32), None, np.float32(-0.5)]
    host = carry.unpacked([None] * 5 + [carry.packed(values + [None] * 4)[-1]])
    assert [np.asarray(host[i]).tolist() for i in carry.small] == [7, [3, 4], -0.5]
    assert Carry(leaves[:1] + leaves[2:3], [True, True]).small == ()  # one small leaf: nothing to pack


def test_a_replaced_state_is_not_kept_alive_by_the_session():
    """``begin_fit`` and ``restore`` put a whole Snapshot back: the session holds its state once
    (a second reference in its frozen value would keep a replaced state's arrays alive)."""
    import gc
    import weakref

    session = Session()
    first = TrainState.create(params={"w": jnp.ones(4)}, opt_state=(), model_state={}, seed=0)
    session.restore(Snapshot(state=first))
    session.begin_fit(FitView(batch_size=4), Position())
    gone = weakref.ref(first)
    del first
    session.stepped(TrainState.create(params={"w": jnp.zeros(4)}, opt_state=(), model_state={}, seed=1))
    gc.collect()
    assert gone() is None
