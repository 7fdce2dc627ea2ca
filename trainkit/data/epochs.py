"""Epochs: how many batches an epoch has and which batches it reads (Keras's
``steps_per_epoch``, a pass continued across epochs, an exact position to resume at).

>>> import numpy as np
>>> from trainkit.data.arrays import ArrayDataset
>>> epoch_steps(ArrayDataset(np.zeros((10, 1))), 4, None, epochs=1)
3
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace

from trainkit.data.batching import Batch
from trainkit.data.source import FIRST_PASS, BatchRequest, Source
from trainkit.data.spans import Rows


def epoch_steps(dataset: Source, batch_size: int, steps_per_epoch: int | None, epochs: int) -> int | None:
    """Batches per epoch: the data's, capped by ``steps_per_epoch``; ``None`` when unknown (an
    iterable without ``len``), which a one-shot iterator allows only for one epoch."""
    steps = dataset.steps(batch_size)
    if steps_per_epoch is not None:
        steps = steps_per_epoch if steps is None else min(steps, steps_per_epoch)
    if steps is None and dataset.one_shot and epochs > 1:
        raise ValueError(
            "A one-shot iterator (such as a generator) cannot be restarted, so with "
            "epochs > 1 pass steps_per_epoch=N to say where an epoch ends."
        )
    return steps


def epochs_until(max_steps: int, steps: int | None, one_shot: bool) -> int:
    """The epochs a ``fit(max_steps=N)`` without ``epochs`` runs (Keras's rule: train until
    ``max_steps``): enough epochs of ``steps`` batches; a one-shot iterator of unknown length is
    one epoch (it is read once, to ``max_steps`` or its end); a re-iterable one of unknown
    length at most ``max_steps`` epochs (each of at least one batch: the run stops at ``max_steps``).

    >>> epochs_until(600, 47, one_shot=False), epochs_until(600, None, one_shot=True)
    (13, 1)
    """
    if steps is not None:
        return -(-max_steps // max(steps, 1))
    return 1 if one_shot else max_steps


def continues_across_epochs(dataset: Source, batch_size: int, steps_per_epoch: int | None) -> bool:
    """Keras's rule: with ``steps_per_epoch`` below the batches of one pass (arrays, or a
    re-iterable with a length), the next epoch continues the pass (see :func:`epoch_batches`)."""
    if steps_per_epoch is None or dataset.one_shot:
        return False
    per_pass = dataset.steps(batch_size)
    return per_pass is not None and steps_per_epoch < per_pass


def epoch_batches(
    dataset: Source,
    batch_size: int,
    epoch: int,
    first: int,
    steps: int | None,
    *,
    continuing: bool = False,
    request: BatchRequest = FIRST_PASS,
    named_rows: bool = False,
) -> Iterator[Batch | Rows]:
    """The batches of epoch ``epoch`` from batch ``first`` on, at most ``steps`` per epoch
    (the order, the data state and the process as ``request`` says).

    ``continuing`` (Keras's ``steps_per_epoch`` smaller than the data): an epoch
    walks on through the pass the previous epoch left, and ends early where that pass ends;
    the next epoch starts a new pass, shuffled by its own index. Epoch ``e`` is thus the
    ``e % E``-th slice of ``steps`` batches of pass ``e // E`` (``E`` epochs per pass), so any
    position ``(epoch, batch)`` maps to one batch (exact resume). ``named_rows``: the batches
    named by their rows, to be gathered later (a source that ``gathers_rows``).

    >>> import numpy as np
    >>> from trainkit.data.arrays import ArrayDataset
    >>> data = ArrayDataset(np.arange(10.0)[:, None], np.arange(10))
    >>> [[b["y"][0].item() for b in epoch_batches(data, 2, e, 0, 4, continuing=True)] for e in range(3)]
    [[0, 2, 4, 6], [8], [0, 2, 4, 6]]
    """
    read = dataset.rows if named_rows else dataset.batches
    if not continuing:
        limit = None if steps is None else max(steps - first, 0)
        return itertools.islice(read(batch_size, replace(request, epoch=epoch, start=first)), limit)
    per_pass = dataset.steps(batch_size)
    assert per_pass is not None and steps is not None  # continuing: a sized dataset and steps_per_epoch
    passes, part = divmod(epoch, -(-per_pass // steps))
    start, end = part * steps + first, min((part + 1) * steps, per_pass)
    batches: Iterator[Batch | Rows] = read(batch_size, replace(request, epoch=passes, start=start))
    return itertools.islice(batches, max(end - start, 0))
