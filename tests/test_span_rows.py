"""A fused call's rows named in one piece: a span of consecutive full batches of a shuffled epoch is
one slice of the epoch's order (``data.spans.span_indices``), the same rows and masks as stacking
each batch's, from any start (a resumed epoch), and never read from an array the order is a view of."""

import itertools

import numpy as np
import pytest

from trainkit.data.arrays import ArrayDataset
from trainkit.data.source import BatchRequest
from trainkit.data.spans import Rows, padded_indices, span_indices


def stacked_one_by_one(span):
    """What a span's indices are by definition: each batch's padded rows, stacked."""
    reals = [np.arange(r.rows.start, r.rows.stop) if isinstance(r.rows, slice) else r.rows for r in span]
    return np.stack([padded_indices(real, r.size) for real, r in zip(reals, span, strict=True)])


def _real_count(named: Rows) -> int:
    return named.rows.stop - named.rows.start if isinstance(named.rows, slice) else len(named.rows)


@pytest.mark.parametrize("shuffle", [True, "batch", False])
@pytest.mark.parametrize("start", [0, 3])
def test_a_span_of_an_epoch_names_the_rows_its_batches_do(shuffle, start):
    rows, batch, k = 100, 8, 4  # 12 full batches and a last one of 4 rows
    dataset = ArrayDataset(np.arange(rows, dtype=np.float32)[:, None], np.zeros(rows, np.int32))
    named = list(dataset.rows(batch, BatchRequest(shuffle=shuffle, seed=1, epoch=2, start=start)))
    assert len(named) == 13 - start
    spans = [named[i : i + k] for i in range(0, len(named), k)]
    fast = [span_indices(span) for span in spans]
    for span, (indices, masks) in zip(spans, fast, strict=True):
        np.testing.assert_array_equal(indices, stacked_one_by_one(span))
        counts = np.array([_real_count(r) for r in span])
        np.testing.assert_array_equal(masks, (np.arange(batch) < counts[:, None]).astype(np.float32))
    everything = np.concatenate([indices.reshape(-1) for indices, _ in fast])
    expected = np.concatenate([stacked_one_by_one([r]).reshape(-1) for r in named])
    np.testing.assert_array_equal(everything, expected)
    if shuffle is True:  # the fast path taken: a view of the order, no copy
        assert fast[0][0].base is not None


def test_rows_of_an_order_that_is_itself_a_view_are_read_from_it():
    bigger = np.arange(100)
    order = bigger[10:30]  # the rows' .base is `bigger`: offsets into `order` must not index it
    span = [Rows(order[2:4], 2, 2), Rows(order[4:6], 2, 4)]
    assert span_indices(span)[0].tolist() == [[12, 13], [14, 15]]


def test_the_fit_loop_reads_a_span_per_call_as_it_did():
    """The reader's spans through ``executions`` (the fit loop's grouping) give every row once per epoch."""
    from trainkit.data.spans import Assembly, executions

    dataset = ArrayDataset(np.arange(64, dtype=np.float32)[:, None], np.zeros(64, np.int32))
    pairs = zip(dataset.rows(8, BatchRequest(shuffle=True, seed=0)), itertools.repeat(None))
    spans = list(executions(pairs, 4, lambda i: 10**9, Assembly(dataset.gather, dataset.gather_stacked)))
    assert [span.steps for span in spans] == [4, 4] and all(span.fused for span in spans)
    seen = np.concatenate([span.batches["x"].reshape(-1) for span in spans])
    assert sorted(seen.tolist()) == list(range(64))
