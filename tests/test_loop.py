"""The loop layer: positions and step records, explicit resume / stop / preempt, exit paths,
and "auto" chosen before anything runs."""

import functools
import signal

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from conftest import classifier, make_classification, saved_steps

import trainkit as tk
from trainkit.callbacks import Callback


@pytest.fixture(scope="module")
def xy():
    return make_classification(64)


make_trainer = functools.partial(classifier, optimizer=optax.sgd(0.1))  # MLP, SGD at 0.1


class Records(Callback):
    def __init__(self):
        self.begin, self.end = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.begin.append(self.session.record)

    def on_train_batch_end(self, batch, logs=None):
        self.end.append((self.session.record, self.session.position))


def test_step_records_and_positions(xy):
    x, y = xy
    records = Records()
    make_trainer().fit((x, y), epochs=2, batch_size=16, verbose=0, callbacks=[records])
    assert [(r.step, r.epoch, r.batch) for r in records.begin][:5] == [
        (1, 0, 0),
        (2, 0, 1),
        (3, 0, 2),
        (4, 0, 3),
        (5, 1, 0),
    ]
    assert records.begin == [record for record, _ in records.end]
    # not async_safe: at batch i's end the loop has not dispatched batch i + 1
    assert all(position == tk.Position(r.epoch, r.batch + 1, r.step) for r, position in records.end)


def test_resume_at_is_an_explicit_request_from_on_train_begin(xy):
    x, y = xy

    class ResumeLater(Callback):
        def on_train_begin(self, logs=None):
            self.session.resume_at(tk.Position(epoch=1, batch=2, step=6))

    records = Records()
    trainer = make_trainer()
    history = trainer.fit((x, y), epochs=3, batch_size=16, verbose=0, callbacks=[ResumeLater(), records])
    assert history.epoch == [1, 2]
    assert (records.begin[0].epoch, records.begin[0].batch, records.begin[0].step) == (1, 2, 7)
    assert trainer.global_step == 6 + 2 + 4


def test_resume_at_converts_a_batch_index_written_with_another_batch_size(xy):
    position = tk.Position(epoch=0, batch=6, step=6)
    assert position.rebatched(8, 16) == tk.Position(0, 3, 6)
    assert position.rebatched(None, 16) == position


def test_preempt_runs_on_train_end_then_raises_preempted(xy):
    x, y = xy
    ended = []

    class Preempt(Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.trainer.global_step == 3:
                self.session.preempt()

        def on_train_end(self, logs=None):
            ended.append(self.trainer.global_step)

    trainer = make_trainer()
    with pytest.raises(tk.Preempted) as raised:
        trainer.fit((x, y), epochs=2, batch_size=16, verbose=0, callbacks=[Preempt()])
    assert raised.value.code == tk.PREEMPTED_EXIT_CODE == 143 and raised.value.step == 3
    assert ended == [3] and trainer.global_step == 3


def test_an_exception_calls_on_exception_not_on_train_end_and_restores_sigterm(xy, tmp_path):
    x, y = xy
    calls = []

    class Boom(Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                raise KeyError("boom")

        def on_train_end(self, logs=None):
            calls.append("train_end")

        def on_exception(self, exception):
            calls.append(("exception", type(exception).__name__))

    def sentinel(signum, frame):  # pragma: no cover - never delivered
        pass

    previous = signal.signal(signal.SIGTERM, sentinel)
    try:
        csv_logger = tk.callbacks.CSVLogger(tmp_path / "log.csv")
        backup = tk.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=1)
        with pytest.raises(KeyError, match="boom"):
            make_trainer().fit((x, y), epochs=2, batch_size=16, verbose=0, callbacks=[backup, csv_logger, Boom()])
        assert calls == [("exception", "KeyError")]
        assert signal.getsignal(signal.SIGTERM) is sentinel  # BackupAndRestore's handler is gone
        assert csv_logger.csv_file is None  # closed
        assert max(saved_steps(tmp_path / "backup")) == 1  # written, kept
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_stop_training_is_keras_flag_on_the_loop(xy):
    trainer = make_trainer()
    assert trainer.stop_training is False
    trainer.stop_training = True
    assert trainer.session.stop_requested
    trainer.stop_training = False
    assert not trainer.session.stop_requested


@pytest.mark.parametrize("first", ["predict", "evaluate", "init"])
def test_auto_chooses_from_the_plan_before_anything_runs(xy, first):
    x, y = xy
    trainer = make_trainer(strategy="auto")
    assert trainer.strategy is None and trainer.state is None  # no placeholder strategy
    if first == "predict":
        outputs = trainer.predict(x, batch_size=16)
        assert outputs.shape == (64, 3)
    elif first == "evaluate":
        assert set(trainer.evaluate((x, y), batch_size=16, return_dict=True)) == {"loss"}
    else:
        trainer.init((x, y))
    assert isinstance(trainer.strategy, tk.Strategy)
    assert trainer.last_plan is not None and trainer.last_plan.recommended.strategy is trainer.strategy
    assert len(trainer.last_plan.rows) > 2  # several candidates were compiled


def test_auto_reuses_the_planned_train_step(xy):
    x, y = xy
    trainer = make_trainer(strategy="auto")
    trainer.fit((x, y), batch_size=16, verbose=0)
    assert trainer.function("train") is trainer.last_plan.recommended.function


@pytest.mark.parametrize("one_shot", [True, False])
def test_a_loader_error_mid_epoch_is_its_own_error_and_the_state_is_intact(one_shot):
    """The loader's exception type and message, with a note naming the batch; the batches
    before it went through their hooks, and the state is that of the last step run."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")

    class Corrupt(Exception):
        pass

    class Loader:
        def __iter__(self):
            for i in range(0, 48, 8):
                if i == 24:
                    raise Corrupt("record 24 is corrupt")
                yield x[i : i + 8], y[i : i + 8]

    ended = []
    data = iter(Loader()) if one_shot else Loader()
    trainer = tk.Trainer(
        nn.Dense(2), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single"
    )
    hook = tk.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: ended.append(batch))
    with pytest.raises(Corrupt, match="record 24 is corrupt") as raised:
        trainer.fit(data, steps_per_epoch=6 if one_shot else None, callbacks=[hook], verbose=0)
    assert any("reading batch 3 of epoch 0; the trainer's state is that of step 3" in n for n in raised.value.__notes__)
    assert ended == [0, 1, 2] and trainer.global_step == 3
    reference = tk.Trainer(
        nn.Dense(2), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single"
    )
    reference.fit([(x[i : i + 8], y[i : i + 8]) for i in range(0, 24, 8)], verbose=0)
    for a, b in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(reference.params)):
        np.testing.assert_array_equal(a, b)
    for run, kind in ((trainer.evaluate, "test"), (trainer.predict, "predict")):
        with pytest.raises(Corrupt, match="record 24 is corrupt") as raised:
            run(iter(Loader()) if one_shot else Loader())
        assert f"trainkit: raised by the data while reading batch 3 for {kind}." in raised.value.__notes__
