"""The input resolved once (``tk.data.prepare``): tuples of inputs stay inputs, a random-access
source is read no further than the first step needs, the model is initialised on a real batch."""

import flax.linen as nn
import numpy as np
import optax
import pytest
from conftest import MLP, PairInputs, classifier, make_classification, tree_allclose

import trainkit as tk


def two_input_trainer():
    return classifier(PairInputs())


def test_a_tuple_of_inputs_trains_exactly_as_a_list():
    x, y = make_classification(48)
    x1, x2 = x[:, :2], x[:, 2:]
    by_list, by_tuple = two_input_trainer(), two_input_trainer()
    listed = by_list.fit([x1, x2], y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    tupled = by_tuple.fit((x1, x2), y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    assert listed["loss"] == tupled["loss"]
    tree_allclose(by_tuple.params, by_list.params, rtol=0, atol=0)
    assert by_tuple.params["first"]["kernel"].shape == (2, 3)  # x1 went to the first input, not as y
    np.testing.assert_array_equal(by_tuple.predict((x1, x2)), by_list.predict([x1, x2]))


class CountingRows:
    """A random-access collection of 200,000 examples that counts the rows read."""

    def __init__(self, rows: int = 200_000):
        self.rows, self.reads = rows, 0

    def __len__(self):
        return self.rows

    def __getitem__(self, index):
        self.reads += 1
        rng = np.random.default_rng(index)
        return rng.normal(size=5).astype(np.float32), np.int32(index % 3)


def trainer_for_source():
    return classifier(optimizer=optax.sgd(0.1))


def test_init_reads_one_batch_of_a_large_random_access_source():
    rows = CountingRows()
    source = tk.sources.RandomAccessSource(rows)
    read_by_the_source = rows.reads  # the source reads one row to learn its structure
    state = trainer_for_source().init(source)
    assert int(state.step) == 0
    assert rows.reads - read_by_the_source <= 32, f"init read {rows.reads - read_by_the_source} rows"


def test_fit_with_max_steps_reads_what_its_steps_need():
    rows = CountingRows()
    source = tk.sources.RandomAccessSource(rows)
    start = rows.reads
    trainer = trainer_for_source()
    trainer.fit(source, batch_size=16, max_steps=2, shuffle=False, verbose=0)
    assert int(trainer.state.step) == 2
    # the first batch (read once by setup) and the two batches trained: nothing is read ahead
    # past max_steps
    assert rows.reads - start <= 16 * 3, f"fit read {rows.reads - start} rows of {len(rows)}"


def test_auto_init_on_a_large_source_plans_a_sample_batch():
    rows = CountingRows()
    source = tk.sources.RandomAccessSource(rows)
    start = rows.reads
    trainer = tk.Trainer(
        MLP(),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.sgd(0.1),
        strategy=tk.strategies.Auto(measure=False),
    )
    trainer.init(source)
    assert trainer.strategy is not None
    assert rows.reads - start <= 32


def test_plan_of_a_source_without_a_batch_size_plans_a_sample_batch():
    rows = CountingRows()
    source = tk.sources.RandomAccessSource(rows)
    start = rows.reads
    plan = trainer_for_source().plan(source, candidates=[tk.SingleDevice()], verbose=0)
    assert plan.recommended is not None
    assert rows.reads - start <= 32
    # the planned step takes a batch of the default 32 rows, not the 200,000 of the source
    sample = (np.zeros((32, 5), np.float32), np.zeros(32, np.int32))
    arrays = trainer_for_source().plan(sample, candidates=[tk.SingleDevice()], verbose=0)
    assert plan.rows[0].argument_bytes == arrays.rows[0].argument_bytes


class PairsOfRows(nn.Module):
    """A model whose shapes only work on real batches: it reshapes rows into pairs."""

    @nn.compact
    def __call__(self, x):
        pairs = x.reshape(x.shape[0] // 2, 2 * x.shape[1])  # fails for one row
        out = nn.Dense(6)(pairs)
        return out.reshape(x.shape[0], 3)


def test_the_model_is_initialised_on_a_real_batch():
    x, y = make_classification(64)
    # it mixes rows on purpose (pairs), which trainkit checks unless told
    trainer = tk.Trainer(
        PairsOfRows(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(0.01), mixes_rows=True
    )
    history = trainer.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert np.isfinite(history.history["loss"][0])
    assert trainer.params["Dense_0"]["kernel"].shape == (10, 6)


@pytest.mark.parametrize("form", ["arrays", "source"])
def test_prepared_says_what_setup_needs(form):
    x, y = make_classification(40)
    data = (x, y) if form == "arrays" else tk.sources.RandomAccessSource(list(zip(x, y)))
    prepared = tk.data.prepare(data, batch_size=16, needs_targets=True)
    assert prepared.batch_size == 16 and prepared.rows == 40
    assert prepared.first_x.shape == (16, 5) and prepared.first_y.shape == (16,)
    assert prepared.spec == ((5,), "float32")
    assert prepared.sample_batch()["mask"].sum() == 16
