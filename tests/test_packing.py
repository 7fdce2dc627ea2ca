"""#83 item 3 (arrays): ``tk.data.pack`` packs documents of token ids into fixed rows with segment ids,
positions restarting per document and a loss mask; each position's target is its own document's next
token; a packed row gives each document the outputs it gets alone (through ``tk.attention``'s segment ids
and per-document positions); bad input is refused by name."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import interrupt_with_backup

import trainkit as tk


def documents(count=12, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 50, size=rng.integers(2, 40)) for _ in range(count)]


def test_every_document_is_packed_whole_in_order_with_its_targets_ids_and_positions():
    docs = documents()
    packed = tk.data.pack(docs, length=32)
    assert all(packed[name].shape == packed["tokens"].shape for name in tk.data.packing.PACKED)
    found = []
    for row in range(len(packed["tokens"])):
        for segment in range(1, packed["segment_ids"][row].max() + 1):
            at = packed["segment_ids"][row] == segment
            np.testing.assert_array_equal(packed["positions"][row][at], np.arange(at.sum()))
            found.append((packed["tokens"][row][at], packed["targets"][row][at]))
    pieces = [(d[:-1][i : i + 32], d[1:][i : i + 32]) for d in docs for i in range(0, len(d) - 1, 32)]
    assert len(found) == len(pieces)
    for (tokens, targets), (want_tokens, want_targets) in zip(found, pieces, strict=True):
        np.testing.assert_array_equal(tokens, want_tokens)
        np.testing.assert_array_equal(targets, want_targets)
    assert packed["loss_mask"].sum() == sum(len(d) - 1 for d in docs)
    assert (packed["tokens"][packed["loss_mask"] == 0] == 0).all() and (
        packed["segment_ids"][packed["loss_mask"] == 0] == 0
    ).all()
    again = tk.data.pack(docs, length=32)
    assert all(np.array_equal(packed[k], again[k]) for k in packed)  # deterministic


class PackedLM(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Embed(50, 16)(x["tokens"]) + nn.Embed(64, 16)(x["positions"])
        b, t, _ = h.shape
        q, k, v = (a.reshape(b, t, 2, 8) for a in jnp.split(nn.Dense(48)(h), 3, -1))
        h = h + nn.Dense(16)(tk.attention(q, k, v, causal=True, segment_ids=x["segment_ids"]).reshape(b, t, 16))
        return nn.Dense(50)(h)


def test_a_packed_row_gives_each_document_its_outputs_alone():
    docs = [np.arange(1, 12), np.arange(20, 29), np.arange(30, 36)]
    packed = tk.data.pack(docs, length=32)
    assert len(packed["tokens"]) == 1  # all three share the row
    x = {k: jnp.asarray(packed[k]) for k in ("tokens", "segment_ids", "positions")}
    params = PackedLM().init(jax.random.key(0), x)
    together = PackedLM().apply(params, x)[0]
    for segment, doc in enumerate(docs, start=1):
        alone = tk.data.pack([doc], length=len(doc) - 1)
        out = PackedLM().apply(params, {k: jnp.asarray(alone[k]) for k in ("tokens", "segment_ids", "positions")})[0]
        np.testing.assert_allclose(together[packed["segment_ids"][0] == segment], out, atol=1e-5)


@pytest.mark.parametrize(
    ("docs", "length", "message"),
    [
        ([[1, 2, 3]], 0, r"length is the positions of a row, a whole number of at least 1; received 0"),
        ([[1, 2], np.ones((2, 2), np.int32)], 4, r"document 1 is not a 1-D sequence of integer token ids"),
        ([[1.5, 2.5]], 4, r"document 0 is not a 1-D sequence of integer token ids.*float64"),
        ([[7], []], 4, r"no document has two tokens or more"),
    ],
    ids=["length", "2-D", "floats", "nothing_to_train"],
)
def test_bad_documents_are_refused_by_name(docs, length, message):
    with pytest.raises(ValueError, match=message):
        tk.data.pack(docs, length=length)


def grain_packed(docs, length=40, batch=4):
    """Documents packed by grain's own packer (``FirstFitPackIterDataset``), as ``fit`` takes them: the model's
    inputs, the targets and the loss mask (a target in its own document) as a per-token ``sample_weight``."""
    grain = pytest.importorskip("grain")
    from grain import experimental

    def as_example(element):
        x = {"tokens": element["inputs"], "segment_ids": element["inputs_segment_ids"]}
        x["positions"] = element["inputs_positions"]
        return x, element["targets"], (element["targets_segment_ids"] > 0).astype(np.float32)

    pieces = grain.MapDataset.source([np.asarray(d, np.int32) for d in docs])
    pieces = pieces.map(lambda d: {"inputs": d[:-1], "targets": d[1:]}).to_iter_dataset()
    packed = experimental.FirstFitPackIterDataset(
        pieces, length_struct={"inputs": length, "targets": length}, num_packing_bins=2, shuffle_bins=False
    )
    return packed.map(as_example).batch(batch, drop_remainder=False)


def test_documents_packed_by_grain_train_and_resume_mid_epoch_bit_identically(tmp_path):
    """#83 item 3 for grain: grain's packer feeds ``fit`` (segment ids, positions, the mask as per-token weights),
    and a fit stopped mid-epoch resumes from the packed iterator's saved position to the parameters of an
    uninterrupted one, bit for bit."""
    import optax

    docs = [np.asarray(d).clip(max=49) for d in documents(count=40, seed=5)]
    data = grain_packed(docs)

    def trainer():
        return tk.Trainer(PackedLM(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2), seed=1,
                          strategy="single")  # fmt: skip

    reference = trainer()
    history = reference.fit(data, epochs=1, verbose=0)
    batches = int(reference.state.step)
    assert batches >= 4 and np.isfinite(history.history["loss"][0])

    backup = tmp_path / "backup"
    manifest = interrupt_with_backup(trainer(), data, backup)
    assert manifest["position"]["batch"] == 2 and manifest["data_state"][0]  # the packer's position, saved
    resumed, seen = trainer(), []
    record = tk.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs=None: seen.append(batch))
    resumed.fit(data, epochs=1, verbose=0, callbacks=[tk.callbacks.BackupAndRestore(backup, save_freq=1), record])
    assert seen == list(range(2, batches))  # from the saved position, nothing replayed
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(reference.params), strict=True):
        np.testing.assert_array_equal(a, b)
