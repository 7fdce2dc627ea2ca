"""#83's inputs of ``tk.attention`` (CPU parts): ``segment_ids=`` (documents packed into one row attend only
within themselves, by XLA's attention and by the Pallas splash kernel, interpreted here; the chip runs the
same kernel: each document's outputs and gradients those of the document run alone), ``window=``, grouped
heads through the kernel, a causal call's alignment, and masks in Keras's shapes and dtypes; each refused
by name where it cannot be meant."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import trainkit as tk

LENGTH, HEADS, DEPTH = 256, 2, 64
FIRST = 100  # the first document's tokens; the second has the rest


def qkv(length=LENGTH, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(k, (1, length, HEADS, DEPTH), jnp.float32) for k in keys]


def packed_ids():
    return jnp.asarray(np.r_[np.ones(FIRST), np.full(LENGTH - FIRST, 2)][None], jnp.int32)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("implementation", ["xla", "pallas-interpret"])
def test_a_packed_row_gives_each_document_its_own_attention_and_gradients(implementation, causal):
    q, k, v = qkv()

    def packed(q, k, v):
        return tk.attention(q, k, v, causal=causal, segment_ids=packed_ids(), implementation=implementation)

    def alone(q, k, v):  # each document by itself (XLA's attention: the reference)
        parts = (slice(0, FIRST), slice(FIRST, LENGTH))
        outs = [tk.attention(q[:, p], k[:, p], v[:, p], causal=causal, implementation="xla") for p in parts]
        return jnp.concatenate(outs, axis=1)

    np.testing.assert_allclose(packed(q, k, v), alone(q, k, v), atol=2e-5, rtol=2e-5)
    weights = jax.random.normal(jax.random.key(9), (1, LENGTH, HEADS, DEPTH))
    grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * weights), argnums=(0, 1, 2))(q, k, v) for f in (packed, alone)]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=5e-5, rtol=5e-5), grads[0], grads[1])


def test_padding_as_a_segment_of_its_own_leaves_the_real_tokens_as_they_were():
    q, k, v = qkv()
    ids = jnp.asarray(np.r_[np.ones(200), np.zeros(LENGTH - 200)][None], jnp.int32)  # 56 padding tokens, id 0
    padded = tk.attention(q, k, v, causal=True, segment_ids=ids)[:, :200]
    np.testing.assert_allclose(padded, tk.attention(q[:, :200], k[:, :200], v[:, :200], causal=True), atol=2e-6)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (jnp.ones((1, LENGTH), jnp.float32), r"integer document ids.*float32"),
        (jnp.ones((1, LENGTH - 1), jnp.int32), r"shape \(1, 255\).*\(batch, length\) = \(1, 256\)"),
        (jnp.ones((LENGTH,), jnp.int32), r"shape \(256,\).*\(batch, length\) = \(1, 256\)"),
    ],
    ids=["float", "short", "no_batch"],
)
def test_segment_ids_that_are_not_one_integer_per_token_are_refused_by_name(ids, message):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=message):
        tk.attention(q, k, v, causal=True, segment_ids=ids)


def packed_lm(strategy):
    """A tiny causal LM whose inputs carry each token's document id: ``{"tokens", "segment_ids"}``."""
    import flax.linen as nn
    import optax

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            tokens, ids = x["tokens"], x["segment_ids"]
            h = nn.Embed(32, 32)(tokens)
            b, t, _ = h.shape
            q, k, v = (a.reshape(b, t, 2, 16) for a in jnp.split(nn.Dense(96)(h), 3, -1))
            h = h + nn.Dense(32)(tk.attention(q, k, v, causal=True, segment_ids=ids).reshape(b, t, 32))
            return nn.Dense(32)(h)

    return tk.Trainer(Model(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy=strategy)


def test_packed_rows_train_on_a_context_axis_to_single_devices_numbers():
    """Item 4 on ``Hybrid(data=2, context=4)``: the ids split with the queries (a mask of XLA's attention split
    by hand), 6 steps of 2 packed rows."""
    from conftest import check_trains_like_single_device

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32, size=(12, 129)).astype(np.int32)
    ids = np.cumsum(rng.random((12, 128)) < 0.05, axis=1).astype(np.int32) + 1  # documents of ~20 tokens
    x = {"tokens": tokens[:, :-1], "segment_ids": ids}
    check_trains_like_single_device(packed_lm, tk.Hybrid(data=2, context=4), x, tokens[:, 1:], batch_size=2, steps=6)


def window_mask(length, left, right, causal):
    i, j = np.arange(length)[:, None], np.arange(length)[None]
    seen = (j >= i - left) & (j <= i + (0 if causal else right))
    return jnp.asarray(seen[None, None])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("implementation", ["xla", "pallas-interpret"])
def test_a_window_is_attention_under_the_equivalent_mask(implementation, causal):
    """#83 item 2: ``window=`` (Mistral's sliding window) by XLA and the kernel's LocalMask, outputs and gradients
    equal to XLA's attention under the same mask written out."""
    q, k, v = qkv()
    left, right = 48, 16

    def windowed(q, k, v):
        return tk.attention(q, k, v, causal=causal, window=(left, right), implementation=implementation)

    def masked(q, k, v):
        return tk.attention(q, k, v, mask=window_mask(LENGTH, left, right, causal), implementation="xla")

    np.testing.assert_allclose(windowed(q, k, v), masked(q, k, v), atol=2e-5, rtol=2e-5)
    weights = jax.random.normal(jax.random.key(9), (1, LENGTH, HEADS, DEPTH))
    grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * weights), argnums=(0, 1, 2))(q, k, v) for f in (windowed, masked)]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=5e-5, rtol=5e-5), grads[0], grads[1])


@pytest.mark.parametrize(
    ("window", "message"),
    [(LENGTH, r"window=256 reaches past the 256 keys.*at most 255"), ((4, -1), r"whole numbers; received \(4, -1\)")],
    ids=["longer_than_the_sequence", "negative"],
)
def test_a_window_that_masks_nothing_or_is_not_whole_numbers_is_refused_by_name(window, message):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=message):
        tk.attention(q, k, v, causal=True, window=window)


def test_grouped_heads_with_packed_documents_and_a_window_match_xla_through_the_kernel():
    """8 query heads over 2 key and value heads (the kernel's multi-query form, no copies), packed documents and
    a causal window together: the kernel's outputs are XLA's under the equivalent mask."""
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (2, LENGTH, 8, DEPTH))
    k, v = (jax.random.normal(key, (2, LENGTH, 2, DEPTH)) for key in keys[1:])
    ids = jnp.concatenate([packed_ids(), jnp.ones((1, LENGTH), jnp.int32)])
    options = {"causal": True, "segment_ids": ids, "window": 40}
    kernel = tk.attention(q, k, v, implementation="pallas-interpret", **options)
    np.testing.assert_allclose(kernel, tk.attention(q, k, v, implementation="xla", **options), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("implementation", ["xla", "pallas-interpret"])
def test_causal_over_more_keys_than_queries_aligns_as_said(implementation):
    """#83 item 5: a decoder's 128 new queries over a cache of 256 keys, ``causal="bottom_right"``: query i sees
    the keys up to 128 + i, as the same rows of a causal self-attention over all 256 positions see them."""
    q, k, v = qkv()
    whole = tk.attention(q, k, v, causal=True, implementation="xla")
    last = tk.attention(q[:, 128:], k, v, causal="bottom_right", implementation=implementation)
    np.testing.assert_allclose(last, whole[:, 128:], atol=2e-5, rtol=2e-5)
    first = tk.attention(q[:, :128], k, v, causal="top_left", implementation="xla")
    np.testing.assert_allclose(first, whole[:, :128], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    ("queries", "keys", "causal", "message"),
    [
        (16, 12, True, r"causal=True with 16 queries and 12 keys does not say how they align.*bottom_right"),
        (16, 12, "bottom_right", r"fewer keys \(12\) leaves the first 4 queries no key"),
        (8, 8, "diagonal", r"causal='diagonal' is not True, False or one of"),
    ],
    ids=["unsaid", "fewer_keys", "unknown"],
)
def test_a_causal_call_whose_alignment_is_unsaid_is_refused_by_name(queries, keys, causal, message):
    q = jnp.ones((1, queries, 2, 8))
    k = jnp.ones((1, keys, 2, 8))
    with pytest.raises(ValueError, match=message):
        tk.attention(q, k, k, causal=causal)


KERAS_MASKS = {  # (batch, S) key padding, and the same in Keras's other shapes
    "(batch, S)": lambda m: m,
    "(batch, 1, S)": lambda m: m[:, None],
    "(batch, T, S)": lambda m: np.broadcast_to(m[:, None], (m.shape[0], 8, 8)),
    "(batch, heads, T, S)": lambda m: np.broadcast_to(m[:, None, None], (m.shape[0], 2, 8, 8)),
}


@pytest.mark.parametrize("dtype", [bool, np.int32, np.float16, np.float32])
@pytest.mark.parametrize("shape", list(KERAS_MASKS))
def test_a_mask_in_kerass_shapes_and_dtypes_is_read_by_its_rank(shape, dtype):
    """#83 item 5: a batch as long as the sequence (8 and 8) is the case a broadcast would misread."""
    q = jax.random.normal(jax.random.key(0), (8, 8, 2, 4))
    padding = np.arange(8)[None, :] < np.arange(1, 9)[:, None]  # row r keeps its first r + 1 keys
    expected = jax.nn.dot_product_attention(q, q, q, mask=jnp.asarray(padding)[:, None, None, :])
    got = tk.attention(q, q, q, mask=jnp.asarray(KERAS_MASKS[shape](padding).astype(dtype)))
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_an_additive_mask_or_a_positions_mask_of_rank_two_is_refused_by_name():
    q = jnp.ones((2, 8, 2, 4))
    additive = jnp.where(jnp.arange(8) < 6, 0.0, -jnp.inf)[None, None, None]
    with pytest.raises(ValueError, match=r"values other than 0 and 1 \(an additive mask.*pass it as bias="):
        tk.attention(q, q, q, mask=additive)
    with pytest.raises(ValueError, match=r"rank 2 is a key padding mask, \(batch, S\) = \(2, 8\).*mask\[None, None\]"):
        tk.attention(q, q, q, mask=jnp.tril(jnp.ones((8, 8), bool)))
