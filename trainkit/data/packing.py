"""Documents of token ids packed into fixed rows, the way MaxText, Levanter and grain train language
models without padding each document to the longest: :func:`pack` fills rows of ``length``
positions with the documents in order, each a segment of its own, and says which document each
position is in (``segment_ids``, for ``tk.attention(..., segment_ids=...)``), where in it
(``positions``, restarting at 0), and which positions train (``loss_mask``). Each position's target
is the next token of its own document, so no position learns across a boundary. Plain NumPy
arrays: an array input of ``fit`` like any other, shuffled, split over devices and resumed
mid-epoch as arrays are.

>>> packed = pack([[5, 6, 7], [8, 9, 10, 11]], length=4)
>>> packed["tokens"].tolist(), packed["targets"].tolist()
([[5, 6, 0, 0], [8, 9, 10, 0]], [[6, 7, 0, 0], [9, 10, 11, 0]])
>>> pack([[1, 2, 3], [4, 5]], length=4)["segment_ids"].tolist()  # two documents share a row
[[1, 1, 2, 0]]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

#: what :func:`pack` returns, each ``(rows, length)``: the model's inputs, the targets, the loss's mask
PACKED = ("tokens", "segment_ids", "positions", "targets", "loss_mask")


def pack(documents: Iterable[Sequence[int] | np.ndarray], length: int, *, pad_id: int = 0) -> dict[str, np.ndarray]:
    """The documents (each a 1-D sequence of token ids) packed in order into rows of ``length``
    positions: a document of ``n`` tokens takes ``n - 1`` positions (its tokens but the last, each
    predicting the next), in the first row it fits after the documents before it, else a new one; a
    document longer than a row is split into rows of ``length``, each piece a segment of its own.
    Returns int32 ``tokens``, ``targets``, ``segment_ids`` (1, 2, ... per row; 0 for padding),
    ``positions`` (0 at each segment's start) and a float32 ``loss_mask`` (1 where a position
    trains), each ``(rows, length)``; padding is ``pad_id`` with mask 0. A document of fewer than
    two tokens has nothing to predict and takes no position."""
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
        raise ValueError(f"pack: length is the positions of a row, a whole number of at least 1; received {length!r}.")
    pieces = [piece for index, document in enumerate(documents) for piece in _pieces(document, index, int(length))]
    if not pieces:
        raise ValueError("pack: no document has two tokens or more, so there is nothing to train on.")
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = [[]]
    used = 0
    for inputs, targets in pieces:
        if used + len(inputs) > length:
            rows.append([])
            used = 0
        rows[-1].append((inputs, targets))
        used += len(inputs)
    packed = {name: np.zeros((len(rows), length), np.float32 if name == "loss_mask" else np.int32) for name in PACKED}
    packed["tokens"][:] = packed["targets"][:] = pad_id
    for row, segments in enumerate(rows):
        start = 0
        for segment, (inputs, targets) in enumerate(segments, start=1):
            end = start + len(inputs)
            packed["tokens"][row, start:end], packed["targets"][row, start:end] = inputs, targets
            packed["segment_ids"][row, start:end] = segment
            packed["positions"][row, start:end] = np.arange(len(inputs))
            packed["loss_mask"][row, start:end] = 1.0
            start = end
    return packed


def _pieces(document: Sequence[int] | np.ndarray, index: int, length: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """A document's (inputs, targets) in pieces of at most ``length`` positions."""
    tokens = np.asarray(document)
    if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
        raise ValueError(
            f"pack: document {index} is not a 1-D sequence of integer token ids (shape {tokens.shape}, dtype "
            f"{tokens.dtype}). Tokenize each document into a list or 1-D array of ints."
        )
    inputs, targets = tokens[:-1], tokens[1:]
    return [(inputs[i : i + length], targets[i : i + length]) for i in range(0, len(inputs), length)]
