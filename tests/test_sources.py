"""Every data adapter reaches the array path's parameters: the same model trained on the same rows
in the same order, on 1 device and on 8 (several processes: tests/test_multihost.py)."""

import threading
import time

import optax
import pytest
from conftest import MLP, interrupt_with_backup, make_classification, tree_allclose

import trainkit as tk
from trainkit.data.prefetch import Prefetcher
from trainkit.data.sources import DataSource, HuggingFaceSource, RandomAccessSource

X, Y = make_classification(72)
BATCH = 16


def train(data, strategy, **fit_options):
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2), strategy=strategy)
    trainer.fit(data, epochs=2, verbose=0, **fit_options)
    assert int(trainer.state.step) == 10  # 72 rows: 5 batches of 16 (the last one padded) per epoch
    return trainer.params


@pytest.fixture(scope="module", params=["single", "dp"])
def strategy(request):
    return request.param


@pytest.fixture(scope="module")
def arrays_shuffled(strategy):
    return train((X, Y), strategy, batch_size=BATCH, shuffle=True)


@pytest.fixture(scope="module")
def arrays_in_order(strategy):
    return train((X, Y), strategy, batch_size=BATCH, shuffle=False)


def examples():
    return [(X[i], Y[i]) for i in range(len(X))]


# ---------------------------------------------------------------- random access: trainkit shuffles
def test_grain_map_dataset_is_shuffled_and_batched_as_arrays_are(strategy, arrays_shuffled):
    grain = pytest.importorskip("grain")
    source = grain.MapDataset.source(examples())
    assert isinstance(tk.data.as_dataset(source), RandomAccessSource)
    tree_allclose(train(source, strategy, batch_size=BATCH, shuffle=True), arrays_shuffled)


def test_grain_map_dataset_with_worker_processes_keeps_the_order(arrays_shuffled, strategy):
    grain = pytest.importorskip("grain")
    if strategy != "single":
        pytest.skip("worker processes are checked once")
    source = RandomAccessSource(grain.MapDataset.source(examples()), workers=2)
    tree_allclose(train(source, "single", batch_size=BATCH, shuffle=True), arrays_shuffled)


def test_hugging_face_dataset_columns(strategy, arrays_shuffled):
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"features": X, "label": Y})
    source = HuggingFaceSource(table, x="features", y="label")
    tree_allclose(train(source, strategy, batch_size=BATCH, shuffle=True), arrays_shuffled)
    default = tk.data.as_dataset(table)  # the label column is the target, the rest a dict of inputs
    assert default.element_spec() == {"features": ((5,), "float32")} and default.has_targets
    with pytest.raises(ValueError, match=r"column\(s\) \['pixels'\] are not in the data.*\['features', 'label'\]"):
        HuggingFaceSource(table, x="pixels", y="label")


def test_torch_map_style_dataset(strategy, arrays_shuffled):
    torch = pytest.importorskip("torch")
    source = torch.utils.data.TensorDataset(torch.from_numpy(X), torch.from_numpy(Y))
    tree_allclose(train(source, strategy, batch_size=BATCH, shuffle=True), arrays_shuffled)


# ---------------------------------------------------------------- iterators: the pipeline batches
def test_torch_data_loader_batches_are_lists(strategy, arrays_in_order):
    torch = pytest.importorskip("torch")
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.from_numpy(X), torch.from_numpy(Y)), batch_size=BATCH
    )
    assert isinstance(next(iter(loader)), list)
    tree_allclose(train(loader, strategy), arrays_in_order)
    with pytest.raises(TypeError, match="wrap it in a torch.utils.data.DataLoader"):

        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                return iter(examples())

        tk.data.as_dataset(Stream())


def test_tf_data_dataset_and_its_dtypes(strategy, arrays_in_order):
    tf = pytest.importorskip("tensorflow")
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)
    tree_allclose(train(dataset, strategy), arrays_in_order)
    assert tk.data.as_dataset(dataset).steps() == 5
    eager = tk.data.as_dataset((tf.constant(X), tf.constant(Y)))  # tf.Tensors: tf.DType becomes a NumPy dtype
    assert eager.element_spec() == ((5,), "float32")


def test_grain_iter_dataset_and_data_loader(strategy, arrays_in_order):
    grain = pytest.importorskip("grain")
    pipeline = grain.MapDataset.source(examples()).to_iter_dataset().batch(BATCH)
    tree_allclose(train(pipeline, strategy), arrays_in_order)
    loader = grain.DataLoader(
        data_source=examples(),
        sampler=grain.samplers.IndexSampler(len(X), shuffle=False, num_epochs=1, seed=0),
        operations=[grain.transforms.Batch(BATCH)],
        worker_count=0,
    )
    assert tk.data.as_dataset(loader).checkpointable
    tree_allclose(train(loader, strategy), arrays_in_order)


def test_a_batched_grain_map_dataset_is_read_as_its_batches(strategy, arrays_in_order):
    """``MapDataset.batch(n)``, as Keras takes grain: its elements are batches, not examples
    (read as examples, every row of a batch was one example of a larger batch)."""
    grain = pytest.importorskip("grain")
    batched = grain.MapDataset.source(examples()).batch(BATCH).map(lambda batch: batch)  # map keeps batches
    assert tk.data.as_dataset(batched).batch_size == BATCH
    tree_allclose(train(batched, strategy), arrays_in_order)
    with pytest.raises(ValueError, match="iterable's batches set the batch size"):
        train(batched, strategy, batch_size=8)


def test_grain_iterator_position_is_saved_and_restored_without_replaying(tmp_path):
    """A fit stopped mid-epoch and resumed with BackupAndRestore ends where an uninterrupted
    one does; the resumed iterator starts at its saved position (DataLoader's bytes state)."""
    grain = pytest.importorskip("grain")

    def loader():
        return grain.DataLoader(
            data_source=examples(),
            sampler=grain.samplers.IndexSampler(len(X), shuffle=True, num_epochs=1, seed=4),
            operations=[grain.transforms.Batch(BATCH)],
            worker_count=0,
        )

    def trainer():  # one explicit strategy: "auto" may time another one faster for the reference
        return tk.Trainer(
            MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2), seed=2, strategy="single"
        )

    reference = trainer()
    reference.fit(loader(), epochs=1, verbose=0)

    backup = tmp_path / "backup"
    manifest = interrupt_with_backup(trainer(), loader(), backup)
    assert manifest["position"]["batch"] == 2 and set(manifest["data_state"][0]) == {"bytes"}
    resumed = trainer()
    seen = []
    resumed.fit(
        loader(),
        epochs=1,
        verbose=0,
        callbacks=[
            tk.callbacks.BackupAndRestore(backup, save_freq=1),
            tk.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs=None: seen.append(batch)),
        ],
    )
    assert seen == [2, 3, 4]
    tree_allclose(resumed.params, reference.params, rtol=0, atol=0)


# ---------------------------------------------------------------- the protocol and the prefetch
def test_a_user_data_source_is_used_as_it_is():
    class Halves:
        """A DataSource of its own: two batches of the first 32 rows."""

        has_targets = True

        def element_spec(self):
            return ((5,), "float32")

        def first(self, rows=1):
            return X[:rows], Y[:rows], None

        def steps(self, batch_size):
            return 2

        def batches(self, batch_size, **options):
            for lo in (0, 16):
                yield tk.data.pad_batch(X[lo : lo + 16], Y[lo : lo + 16], None, batch_size)

    assert isinstance(Halves(), DataSource)
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1))
    trainer.fit(Halves(), batch_size=16, epochs=1, verbose=0)
    assert int(trainer.state.step) == 2


def test_prefetch_reads_ahead_in_a_thread_and_raises_errors_in_order():
    read_by = []

    def batches():
        for i in range(3):
            read_by.append(threading.current_thread().name)
            yield i
        raise OSError("disk gone")

    got = []
    with Prefetcher(batches(), depth=2) as items, pytest.raises(OSError, match="disk gone"):
        for item in items:
            got.append(item)
    assert got == [0, 1, 2] and set(read_by) == {"trainkit-prefetch"}
    slow = Prefetcher(iter(lambda: time.sleep(0.01) or 1, None), depth=2)
    next(slow)
    slow.close()  # stops an endless reader
    assert not slow._thread.is_alive()


def test_fit_reads_batches_off_the_main_thread_one_shot_iterators_too():
    threads = []

    class Loader:
        def __iter__(self):
            for i in range(0, 32, 16):
                threads.append(threading.current_thread() is threading.main_thread())
                yield X[i : i + 16], Y[i : i + 16]

    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1))
    trainer.fit(Loader(), epochs=2, verbose=0)
    assert threads[0] and not any(threads[1:])  # only the batch read to learn the shapes is on the main thread
    threads.clear()
    trainer.fit(iter(Loader()), epochs=1, verbose=0)  # read ahead; what a stop leaves is handed back
    assert threads[0] and not any(threads[1:])


def test_a_source_whose_length_changes_between_epochs_is_refused_naming_both_lengths():
    """Rows 64-255 of a grown source were never trained: the epoch length was the first one."""
    rows = examples()[:64]
    source = RandomAccessSource(rows)
    grow = tk.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs=None: rows.extend(examples()[:8]))
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single")
    with pytest.raises(ValueError, match=r"had 64 rows when fit started and has 72 now"):
        trainer.fit(source, batch_size=16, epochs=2, verbose=0, callbacks=[grow])
    assert trainer.global_step == 4  # the first epoch, on the first length
    trainer.fit(RandomAccessSource(rows), batch_size=16, epochs=1, verbose=0)  # wrapped anew: all 72 rows
    assert trainer.global_step == 4 + 5


class Rows:
    """A grain data source without a __repr__ of its own (then with one)."""

    def __init__(self):
        self.rows = examples()

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class NamedRows(Rows):
    def __repr__(self):
        return f"NamedRows({len(self.rows)} rows)"


@pytest.mark.parametrize("source_class", [Rows, NamedRows])
def test_a_grain_data_loader_position_needs_a_stable_data_source_repr(tmp_path, source_class):
    """grain matches the data source by repr() at resume; the default repr differs every run, so
    a backup of its position could never be restored: refused when it is saved."""
    grain = pytest.importorskip("grain")
    loader = grain.DataLoader(
        data_source=source_class(),
        sampler=grain.samplers.IndexSampler(len(X), shuffle=False, num_epochs=1, seed=0),
        operations=[grain.transforms.Batch(BATCH)],
        worker_count=0,
    )
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single")
    backup = tk.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=2)
    if source_class is Rows:
        with pytest.raises(
            ValueError, match=r"checks its data source by repr\(\).*Give the data source class a __repr__"
        ):
            trainer.fit(loader, epochs=1, verbose=0, callbacks=[backup])
    else:
        trainer.fit(loader, epochs=1, verbose=0, callbacks=[backup])
        assert trainer.global_step == 5
