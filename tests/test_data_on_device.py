"""A fused call fed in one piece: the host gathers its batches with one take of each array
(``ArrayDataset.gather_stacked``), or with ``fit(..., data_on_device=True)`` the devices keep
the rows and the call gathers them itself; either way the numbers are those of batch-by-batch
assembly, on every strategy that gathers on its devices."""

import functools
import itertools

import jax
import numpy as np
import pytest
from conftest import MLP, classifier, make_classification, strategy_table

import trainkit as tk
from trainkit.data import ArrayDataset, BatchRequest
from trainkit.data.spans import Rows, stack

STRATEGIES = strategy_table(min_shard_size=8)
make = functools.partial(classifier, MLP(), seed=3)


def spans_of(source: ArrayDataset, batch_size: int, k: int, request: BatchRequest) -> list[list[Rows]]:
    rows = list(source.rows(batch_size, request))
    return [rows[i : i + k] for i in range(0, len(rows), k)]


def assert_same_batches(ours, theirs):
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("shuffle", [False, True, "batch"])
@pytest.mark.parametrize("share", [(0, 1), (1, 2)], ids=["one_process", "second_of_two"])
def test_one_piece_gather_equals_batch_by_batch(shuffle, share):
    """Every span of 3 batches of 50 rows in 8 (full, padded and, for the second of two
    processes, empty parts) gathered in one piece equals the stack of its batches."""
    rng = np.random.default_rng(0)
    x = {"a": rng.normal(size=(50, 3)).astype(np.float32), "b": rng.integers(0, 9, (50, 2))}
    source = ArrayDataset(x, rng.integers(0, 3, 50), rng.random(50))
    request = BatchRequest(shuffle=shuffle, seed=4, epoch=1, process_index=share[0], process_count=share[1])
    spans = spans_of(source, 8, 3, request)
    assert len(spans) == 3
    for span in spans:
        assert_same_batches(source.gather_stacked(span), stack([source.gather(rows) for rows in span]))
    # and the batches themselves are those batches() yields
    per_batch = [source.gather(rows) for rows in itertools.chain(*spans)]
    for ours, theirs in zip(per_batch, source.batches(8, request), strict=True):
        assert_same_batches(ours, theirs)


def test_rows_on_the_devices_are_the_host_batches():
    """What a gathered call indexes equals the host's stacked batches, padding and masks included."""
    x, y = make_classification(45)
    source = ArrayDataset(x, y, np.linspace(0, 1, 45))
    (span,) = spans_of(source, 16, 3, BatchRequest(shuffle=True, epoch=2))
    indexed = source.indexed_stacked(span)
    table = source.table()
    gathered = {name: part[indexed.rows] for name, part in table.items()} | {"mask": indexed.mask}
    assert indexed.mask.tolist()[-1] == [1.0] * 13 + [0.0] * 3
    assert_same_batches(gathered, source.gather_stacked(span))


@pytest.mark.parametrize("strategy", ["single", "fsdp8", "hybrid2x4_fsdp"])
def test_data_on_device_trains_as_the_host_feeds(strategy, data):
    """Two shuffled epochs of 7 fused batches (the last padded, weighted rows): the same losses and
    weights whether the host sends the batches or the devices gather them; the gathered call ran."""
    x, y = data
    weights = np.linspace(0.5, 1.5, len(x)).astype(np.float32)
    results = []
    for on_device in (False, True):
        trainer = make(strategy=STRATEGIES[strategy](), steps_per_execution=7)
        history = trainer.fit(x, y, sample_weight=weights, batch_size=16, epochs=2, verbose=0, data_on_device=on_device)
        assert trainer.compiled.has("train_steps_gathered") == on_device
        results.append((history.history["loss"], jax.tree.leaves(trainer.get_weights())))
    (loss, weights_host), (loss_device, weights_device) = results
    np.testing.assert_allclose(loss_device, loss, rtol=1e-6)
    for ours, theirs in zip(weights_device, weights_host, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-6)


def test_data_on_device_resumes_exactly(data):
    """An epoch, then another from initial_epoch=1 (the rows placed again), equals two straight."""
    x, y = data
    straight = make(steps_per_execution=4)
    straight.fit(x, y, batch_size=16, epochs=2, verbose=0, data_on_device=True)
    split = make(steps_per_execution=4)
    split.fit(x, y, batch_size=16, epochs=1, verbose=0, data_on_device=True)
    split.fit(x, y, batch_size=16, epochs=2, initial_epoch=1, verbose=0, data_on_device=True)
    for a, b in zip(jax.tree.leaves(split.get_weights()), jax.tree.leaves(straight.get_weights()), strict=True):
        np.testing.assert_array_equal(a, b)


def test_auto_keeps_the_data_on_the_host_of_a_cpu(data):
    """On a CPU the devices' memory is the host's: "auto" sends the gathered batches (measured no slower)."""
    x, y = data
    trainer = make(steps_per_execution=4)
    trainer.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert trainer.compiled.has("train_steps") and not trainer.compiled.has("train_steps_gathered")


def batches_of(x, y):
    return [(x[i : i + 16], y[i : i + 16]) for i in range(0, 96, 16)]


@pytest.mark.parametrize(
    "case, expected",
    [
        ("pmap", "does not gather a fused call's batches on its devices"),
        ("context", "under a context axis or a pipeline the step splits or schedules the batch"),
        ("iterable", "not in-memory arrays"),
        ("too_large", "more than 25% of its"),
        ("not_a_setting", "data_on_device must be 'auto', True or False; received 'yes'"),
    ],
)
def test_data_on_device_refused_by_name(case, expected, data, monkeypatch):
    x, y = data
    strategies = {"pmap": tk.DataParallel, "context": lambda: tk.Hybrid(data=2, context=4)}
    trainer = make(strategy=strategies.get(case, tk.SingleDevice)(), steps_per_execution=2)
    setting = "yes" if case == "not_a_setting" else True
    inputs = (batches_of(x, y), None) if case == "iterable" else (x, y)
    if case == "context":  # 8 positions a row, split over the context axis's 4 devices
        inputs = make_classification(100, features=8)
    if case == "too_large":
        x, y = make_classification(4096, features=64)
        inputs = (x, y)
        monkeypatch.setenv("TRAINKIT_DEVICE_MEMORY", str(3 * 2**20))  # the rows take 1.0 MiB
    with pytest.raises(ValueError, match=expected):
        trainer.fit(*inputs, batch_size=16, epochs=1, verbose=0, data_on_device=setting)
    assert trainer.global_step == 0
