"""A one-shot generator is read ahead in a background thread, and what a stop leaves unread
by training is handed back to the same iterator: the next ``fit`` on it starts there."""

import time

import numpy as np
import pytest
from conftest import classifier, make_classification, tree_allclose

import trainkit as tk
from trainkit.data.prefetch import ReadAhead

ROWS = 8


def numbered(batches, seen):
    for index, batch in enumerate(batches):
        seen.append(index)
        yield batch


class StopAfter(tk.callbacks.Callback):
    """Stops after batch ``last``, once the read-ahead had time to run past it."""

    def __init__(self, last):
        self.last = last

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.last:
            time.sleep(0.2)
            self.model.stop_training = True


make_trainer = classifier  # MLP, Adam at 0.05, one device


def test_a_stop_loses_no_batch_of_a_generator_read_ahead():
    x, y = make_classification(6 * ROWS)
    batches = [(x[i : i + ROWS], y[i : i + ROWS]) for i in range(0, len(x), ROWS)]
    seen = []
    generator = numbered(batches, seen)
    trainer = make_trainer()
    trainer.fit(generator, steps_per_epoch=6, callbacks=[StopAfter(2)], shuffle=False, verbose=0)
    assert trainer.global_step == 3
    assert len(seen) > 3  # the thread read past the stop: those batches were handed back
    trainer.fit(generator, steps_per_epoch=3, shuffle=False, verbose=0)

    reference = make_trainer()  # the same six batches, three and three
    reference.fit(iter(batches[:3]), steps_per_epoch=3, shuffle=False, verbose=0)
    reference.fit(iter(batches[3:]), steps_per_epoch=3, shuffle=False, verbose=0)
    assert trainer.global_step == reference.global_step == 6
    tree_allclose(trainer.params, reference.params, rtol=0, atol=0)


def test_epochs_over_one_generator_train_every_batch_once_in_order():
    x, y = make_classification(8 * ROWS)
    batches = [(x[i : i + ROWS], y[i : i + ROWS]) for i in range(0, len(x), ROWS)]
    trainer, reference = make_trainer(), make_trainer()
    trainer.fit(numbered(batches, []), steps_per_epoch=2, epochs=4, shuffle=False, verbose=0)
    reference.fit(batches, epochs=1, shuffle=False, verbose=0)  # a list: the same 8 batches in order
    tree_allclose(trainer.params, reference.params, rtol=0, atol=0)


def test_a_loader_error_is_raised_in_order_after_the_batches_before_it():
    def broken():
        yield np.ones((4, 3), np.float32)
        yield np.ones((4, 3), np.float32)
        raise OSError("disk gone")

    reader = ReadAhead(broken(), depth=4, handed_back=[])
    assert next(reader).shape == next(reader).shape == (4, 3)
    with pytest.raises(OSError, match="disk gone"):
        next(reader)


def refilled(batches):
    """A loader that refills one preallocated buffer and yields it again for every batch."""
    x_buffer, y_buffer = np.empty_like(batches[0][0]), np.empty_like(batches[0][1])
    for x, y in batches:
        x_buffer[...], y_buffer[...] = x, y
        yield x_buffer, y_buffer


@pytest.mark.parametrize("k", [1, 4])
def test_a_generator_that_refills_one_buffer_trains_every_row_it_yielded(k):
    x, y = make_classification(8 * ROWS)
    batches = [(x[i : i + ROWS], y[i : i + ROWS]) for i in range(0, len(x), ROWS)]
    trained, reference = make_trainer(steps_per_execution=k), make_trainer(steps_per_execution=k)
    trained.fit(refilled(batches), steps_per_epoch=8, shuffle=False, verbose=0)
    reference.fit([(a.copy(), b.copy()) for a, b in batches], shuffle=False, verbose=0)
    assert trained.global_step == reference.global_step == 8
    tree_allclose(trained.params, reference.params, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["iter", "map", "zip", "islice"])
def test_init_keeps_the_first_batch_of_any_one_shot_iterator_for_fit(kind):
    import itertools

    x, y = make_classification(4 * ROWS)
    batches = [(x[i : i + ROWS], y[i : i + ROWS]) for i in range(0, len(x), ROWS)]
    source = {
        "iter": lambda: iter(batches),
        "map": lambda: map(lambda b: b, batches),
        "zip": lambda: zip([b[0] for b in batches], [b[1] for b in batches]),
        "islice": lambda: itertools.islice(batches, None),
    }[kind]()
    trainer, reference = make_trainer(), make_trainer()
    trainer.init(source)  # reads the first batch to learn the shapes
    trainer.fit(source, steps_per_epoch=4, shuffle=False, verbose=0)
    reference.fit(batches, shuffle=False, verbose=0)
    assert trainer.global_step == 4
    tree_allclose(trainer.params, reference.params, rtol=0, atol=0)


def thread_tied(batches, owner):
    """A generator that, as a sqlite cursor does, works only in the thread that opened it."""
    import threading

    for batch in batches:
        if threading.get_ident() != owner:
            raise RuntimeError("objects created in a thread can only be used in that same thread")
        yield batch


def test_read_ahead_false_reads_a_thread_tied_generator_in_the_calling_thread():
    import threading

    x, y = make_classification(4 * ROWS)
    batches = [(x[i : i + ROWS], y[i : i + ROWS]) for i in range(0, len(x), ROWS)]
    owner = threading.get_ident()
    with pytest.raises(RuntimeError, match="same thread"):
        make_trainer().fit(thread_tied(batches[1:], owner), steps_per_epoch=3, shuffle=False, verbose=0)
    trainer, reference = make_trainer(), make_trainer()
    validation = thread_tied(batches[:1], owner)
    trainer.fit(
        thread_tied(batches[1:], owner),
        steps_per_epoch=3,
        validation_data=validation,
        shuffle=False,
        verbose=0,
        read_ahead=False,
    )
    reference.fit(batches[1:], validation_data=batches[:1], shuffle=False, verbose=0)
    assert trainer.global_step == 3
    tree_allclose(trainer.params, reference.params, rtol=0, atol=0)
    assert trainer.history.history["val_loss"] == pytest.approx(reference.history.history["val_loss"], rel=1e-6)


@pytest.mark.parametrize("epochs, per_epoch, max_steps", [(1, 10, None), (2, 5, None), (None, 4, 10)])
def test_after_fit_the_generator_continues_at_the_first_batch_fit_did_not_train(epochs, per_epoch, max_steps):
    x, y = make_classification(20 * ROWS)
    batches = [(x[i : i + ROWS], y[i : i + ROWS]) for i in range(0, len(x), ROWS)]
    seen = []
    generator = numbered(batches, seen)
    trainer = make_trainer()
    trainer.fit(generator, epochs=epochs, steps_per_epoch=per_epoch, max_steps=max_steps, shuffle=False, verbose=0)
    assert trainer.global_step == 10
    np.testing.assert_array_equal(next(generator)[0], batches[10][0])  # nothing waits in a backlog
    assert seen == list(range(11))


def test_find_batch_size_keeps_the_first_batch_of_a_map_iterator_for_fit():
    x, y = make_classification(4 * ROWS)
    batches = [(x[i : i + ROWS], y[i : i + ROWS]) for i in range(0, len(x), ROWS)]
    source = map(lambda batch: batch, batches)
    trainer, reference = make_trainer(), make_trainer()
    trainer.find_batch_size(source, verbose=0)  # reads the first batch to learn the shapes
    trainer.fit(source, steps_per_epoch=4, shuffle=False, verbose=0)
    reference.fit(batches, shuffle=False, verbose=0)
    assert trainer.global_step == 4
    tree_allclose(trainer.params, reference.params, rtol=0, atol=0)


def test_a_real_sqlite_cursor_read_ahead_fails_naming_read_ahead_false(tmp_path):
    """sqlite3 refuses a connection used outside the thread that made it; the error raised by
    fit names the fix, and with ``read_ahead=False`` the same generator trains."""
    import sqlite3

    x, y = make_classification(4 * ROWS)

    def rows_from(connection):
        cursor = connection.execute("SELECT x, y FROM rows ORDER BY id")
        while chunk := cursor.fetchmany(ROWS):
            yield np.stack([np.frombuffer(r[0], np.float32) for r in chunk]), np.array([r[1] for r in chunk], np.int32)

    def database():
        connection = sqlite3.connect(tmp_path / "rows.db")
        connection.execute("CREATE TABLE IF NOT EXISTS rows (id INTEGER PRIMARY KEY, x BLOB, y INTEGER)")
        if not connection.execute("SELECT COUNT(*) FROM rows").fetchone()[0]:
            connection.executemany(
                "INSERT INTO rows (x, y) VALUES (?, ?)", [(r.tobytes(), int(t)) for r, t in zip(x, y)]
            )
            connection.commit()
        return connection

    with pytest.raises(RuntimeError, match=r"read-ahead thread \(ProgrammingError: SQLite objects created in a thread.*"
                       r"pass read_ahead=False to fit"):  # fmt: skip
        make_trainer().fit(rows_from(database()), steps_per_epoch=4, shuffle=False, verbose=0)
    trainer = make_trainer()
    trainer.fit(rows_from(database()), steps_per_epoch=4, shuffle=False, verbose=0, read_ahead=False)
    assert trainer.global_step == 4
