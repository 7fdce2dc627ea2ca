"""Callbacks: History, EarlyStopping, CSVLogger, TerminateOnNaN, LambdaCallback, ProgressBar."""

import csv
import functools
import io
import math
import re

import numpy as np
import optax
import pytest
from conftest import MLP, classifier, make_classification
from rich.console import Console

import trainkit as tk
from trainkit.callbacks import Callback, CSVLogger, EarlyStopping, LambdaCallback, ProgressBar, TerminateOnNaN


@pytest.fixture(scope="module")
def xy():
    return make_classification(64)


make_trainer = functools.partial(classifier, metrics=["accuracy"])  # MLP, Adam at 0.05, one device


def test_history_is_keras_compatible(xy):
    x, y = xy
    history = make_trainer().fit((x, y), epochs=3, batch_size=16, validation_data=(x, y), verbose=0)
    assert history.epoch == [0, 1, 2]
    assert list(history.history) == ["accuracy", "loss", "val_accuracy", "val_loss"]  # sorted, as Keras
    assert all(len(v) == 3 for v in history.history.values())
    assert history.params == {"epochs": 3, "steps": 4, "verbose": 0}


def test_callbacks_see_every_hook_in_order_and_can_stop(xy):
    x, y = xy
    events = []

    class Recorder(Callback):
        def on_train_begin(self, logs=None):
            events.append("train_begin")

        def on_epoch_begin(self, epoch, logs=None):
            events.append(f"epoch_begin{epoch}")

        def on_train_batch_end(self, batch, logs=None):
            events.append(f"batch{batch}")
            assert set(logs) == {"loss", "accuracy"}
            if self.trainer.global_step >= 6:
                self.trainer.stop_training = True

        def on_test_end(self, logs=None):
            events.append("test_end")

        def on_epoch_end(self, epoch, logs=None):
            events.append(f"epoch_end{epoch}")

        def on_train_end(self, logs=None):
            events.append("train_end")

    trainer = make_trainer()
    trainer.fit((x, y), epochs=5, batch_size=16, validation_data=(x, y), callbacks=[Recorder()], verbose=0)
    assert events[:7] == ["train_begin", "epoch_begin0", "batch0", "batch1", "batch2", "batch3", "test_end"]
    assert events[-1] == "train_end" and "epoch_end1" in events and "epoch_begin2" not in events
    # a callback that is not async_safe sees each batch before the next runs: no step after the stop
    assert trainer.global_step == 6


def test_early_stopping_patience_and_restore_best_weights(xy):
    x, y = xy
    values = iter([1.0, 0.5, 0.7, 0.6, 0.9, 0.1])
    snapshots = {}

    class FakeMetric(Callback):  # injects a controlled val_metric before EarlyStopping reads it
        def on_epoch_end(self, epoch, logs=None):
            logs["val_metric"] = next(values)
            snapshots[epoch] = self.trainer.get_weights()

    stopper = EarlyStopping(
        monitor="val_metric", mode="min", patience=2, restore_best_weights=True
    )  # Keras needs the mode too
    trainer = make_trainer()
    history = trainer.fit((x, y), epochs=6, batch_size=16, callbacks=[FakeMetric(), stopper], verbose=0)
    assert history.epoch == [0, 1, 2, 3] and stopper.stopped_epoch == 3 and stopper.best_epoch == 1
    assert not np.array_equal(snapshots[3]["params"]["Dense_0"]["kernel"], snapshots[1]["params"]["Dense_0"]["kernel"])
    np.testing.assert_array_equal(trainer.params["Dense_0"]["kernel"], snapshots[1]["params"]["Dense_0"]["kernel"])


def test_early_stopping_mode_auto_and_min_delta():
    assert EarlyStopping(monitor="val_accuracy").mode == "max"
    assert EarlyStopping(monitor="val_loss").mode == "min"
    stopper = EarlyStopping(monitor="loss", min_delta=0.1)
    assert stopper._is_improvement(1.0, None) and not stopper._is_improvement(0.95, 1.0)
    assert stopper._is_improvement(0.85, 1.0)
    with pytest.raises(ValueError, match="mode must be"):
        EarlyStopping(mode="smallest")


def test_missing_monitored_metric_warns_with_the_existing_names(xy):
    x, y = xy
    with pytest.warns(UserWarning, match=r"'val_loss', which is not among the logged metrics: accuracy, loss"):
        make_trainer().fit((x, y), epochs=1, batch_size=16, callbacks=[EarlyStopping()], verbose=0)


def test_csv_logger_writes_one_row_per_epoch(xy, tmp_path):
    x, y = xy
    path = tmp_path / "log.csv"
    history = make_trainer().fit(
        (x, y), epochs=2, batch_size=16, validation_data=(x, y), callbacks=[CSVLogger(path)], verbose=0
    )
    rows = list(csv.DictReader(open(path)))
    assert [r["epoch"] for r in rows] == ["0", "1"]
    assert float(rows[1]["val_accuracy"]) == pytest.approx(history.history["val_accuracy"][1])
    make_trainer().fit(
        (x, y), epochs=1, batch_size=16, validation_data=(x, y), callbacks=[CSVLogger(path, append=True)], verbose=0
    )
    assert len(list(csv.DictReader(open(path)))) == 3


def test_terminate_on_nan_names_the_step(xy):
    x, y = xy
    x_bad = x.copy()
    x_bad[20] = np.inf  # the second batch of 16 holds an infinite input
    stopper = TerminateOnNaN()
    trainer = make_trainer()
    with pytest.warns(UserWarning, match=r"loss became nan at batch 1 of epoch 0 \(step 2,"):
        history = trainer.fit((x_bad, y), epochs=3, batch_size=16, shuffle=False, callbacks=[stopper], verbose=0)
    assert history.epoch == [0] and math.isnan(history.history["loss"][0])
    assert stopper.stopped_step == 2


def test_lambda_callback(xy):
    x, y = xy
    seen = []
    callback = LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append((epoch, logs["loss"])))
    history = make_trainer().fit((x, y), epochs=2, batch_size=16, callbacks=[callback], verbose=0)
    assert seen == list(zip([0, 1], history.history["loss"]))
    with pytest.raises(ValueError, match="unknown hook 'on_epoch_finish'"):
        LambdaCallback(on_epoch_finish=print)


def test_progress_bar_shows_epochs_rate_and_metrics(xy):
    x, y = xy
    buffer = io.StringIO()
    console = Console(file=buffer, width=200, force_terminal=False)
    make_trainer().fit(
        (x, y), epochs=2, batch_size=16, validation_data=(x, y), callbacks=[ProgressBar(1, console=console)]
    )
    text = buffer.getvalue()
    assert "Epoch 1/2" in text and "Epoch 2/2" in text and "4/4" in text
    assert "steps/s" in text and "val_accuracy:" in text
    assert "eta" not in text  # a log that is not a terminal gets each epoch's last frame: no "eta 0:00:00"
    steps, examples = re.search(r"([\d.]+) steps/s, ([\d,]+) examples/s", text).groups()
    # one rate, shown as steps (to 0.1) and as examples of the batch of 16 rows (to 1)
    assert abs(float(steps) - float(examples.replace(",", "")) / 16) <= 0.05 + 0.5 / 16 + 1e-9


def test_the_remaining_time_shows_while_an_epoch_runs_only():
    from rich.progress import Progress

    from trainkit.callbacks.progress import _Remaining

    progress = Progress()
    task = progress.add_task("Epoch 1/1", total=10)
    progress.update(task, completed=3)
    assert _Remaining().render(progress.tasks[0]).plain.startswith("eta ")
    progress.update(task, completed=10)
    assert _Remaining().render(progress.tasks[0]).plain == ""


def test_verbose_auto_draws_the_bar_as_verbose_1(xy, capsys):
    """Keras's ``verbose="auto"`` is 1 for ``fit``: the bar fit adds draws its epochs, as with verbose=1."""
    x, y = xy
    make_trainer().fit((x, y), epochs=1, batch_size=16, verbose=1)
    one = capsys.readouterr().out
    make_trainer().fit((x, y), epochs=1, batch_size=16, verbose="auto")
    auto = capsys.readouterr().out
    assert "Epoch 1/1" in one and "4/4" in one
    assert "Epoch 1/1" in auto and "4/4" in auto


def test_verbose_zero_prints_nothing(xy, capsys):
    x, y = xy
    make_trainer().fit((x, y), epochs=1, batch_size=16, verbose=0)
    assert capsys.readouterr().out == ""


def test_terminate_on_nan_names_the_first_bad_batch_of_an_execution(xy):
    """steps_per_execution=4: the hook comes after batch 7 (step 8), the loss went bad at batch 5."""
    x, y = xy
    x_big, y_big = np.concatenate([x] * 3), np.concatenate([y] * 3)  # 8 batches of 16 or more
    x_big[5 * 16 + 3] = np.inf  # batch 5 (step 6)
    stopper = TerminateOnNaN()
    trainer = tk.Trainer(
        MLP(),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.sgd(0.1),
        strategy="single",
        steps_per_execution=4,
    )
    with pytest.warns(UserWarning, match=r"loss became nan at batch 5 of epoch 0 \(step 6,"):
        trainer.fit((x_big, y_big), epochs=2, batch_size=16, shuffle=False, callbacks=[stopper], verbose=0)
    assert stopper.stopped_step == 6 and trainer.global_step == 8  # the execution's steps ran, no more


@pytest.mark.parametrize("width", [80, 100])
def test_a_narrow_bar_keeps_the_bar_the_step_counter_and_the_loss(xy, width):
    x, y = xy
    log = io.StringIO()
    bar = ProgressBar(1, console=Console(file=log, width=width))
    frames = []

    def snapshot(batch, logs=None):
        if batch == 2:  # the bar drew batch 0's logs at once
            out = Console(file=io.StringIO(), width=width, record=True)
            out.print(bar._progress.make_tasks_table(bar._progress.tasks))
            frames.append(out.export_text())

    make_trainer().fit((x, y), epochs=1, batch_size=8, callbacks=[LambdaCallback(on_train_batch_end=snapshot), bar])
    (frame,) = frames
    assert "━" in frame and re.search(r"\b\d+/\d+\b", frame), frame
    assert re.search(r"loss: \d\.\d{4}", frame), frame  # the loss, in full, not cut off by the rate
    assert all(len(line) <= width for line in frame.splitlines())
    last = log.getvalue().splitlines()[0]  # the epoch's last frame (a log file gets only that): no metrics, room
    assert re.search(r"\d:\d\d:\d\d .*steps/s, [\d,]+ examples/s", last) and len(last.rstrip()) <= width, last


def test_the_bar_and_verbose_2_print_the_same_digits(xy):
    x, y = xy
    lines = {}
    for verbose in (1, 2):
        buffer = io.StringIO()
        options = {"epochs": 1, "batch_size": 16, "shuffle": False}
        make_trainer().fit((x, y), **options, callbacks=[ProgressBar(verbose, console=Console(file=buffer, width=200))])
        lines[verbose] = re.search(r"accuracy: \S+ - loss: \S+", buffer.getvalue()).group()
    assert lines[1] == lines[2] and re.fullmatch(r"accuracy: \d\.\d{4} - loss: \d\.\d{4}", lines[1])


def test_a_value_added_to_the_batch_logs_without_reading_them_reaches_the_next_reader(xy):
    """Keras gives the callbacks of a list one logs dict. A callback that adds a value but reads no
    metric (``reads_batch_logs`` False: no device read for it, as GradientStats) still hands it on:
    the next callback that reads gets the metrics and the value."""
    x, y = xy

    class Adds(Callback):
        async_safe = True

        def reads_batch_logs(self):
            return False

        def on_train_batch_end(self, batch, logs=None):
            assert "loss" not in logs  # nothing read for it
            logs["lr_seen"] = float(batch)

    class Reads(Callback):
        def __init__(self):
            self.seen = []

        def on_train_batch_end(self, batch, logs=None):
            self.seen.append((logs["lr_seen"], "loss" in logs))

    reader = Reads()
    make_trainer().fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[Adds(), reader])
    assert reader.seen == [(0.0, True), (1.0, True), (2.0, True), (3.0, True)], reader.seen
