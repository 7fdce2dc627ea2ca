"""``tk.attention``'s implementations (#71, its first part): the Pallas splash kernel, run here by JAX's
Pallas interpreter (``implementation="pallas-interpret"``: the kernel's own code on a CPU), gives XLA's
attention's outputs and gradients in float32, grouped key and value heads included; a model written with
it trains to XLA attention's numbers on one device and on eight; the choice per device and shape routes
what the kernel cannot take to XLA with a note, and refuses an implementation that cannot run by name."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import trainkit as tk
from trainkit.attn import kernels as attention_kernels

BATCH, LENGTH, HEADS, DEPTH = 2, 256, 4, 32


def arrays(kv_heads=HEADS, length=LENGTH):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(BATCH, length, HEADS, DEPTH)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(BATCH, length, kv_heads, DEPTH)), jnp.float32) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("kv_heads", [HEADS, 2], ids=["heads", "grouped"])
def test_the_kernel_gives_xla_attentions_outputs_and_gradients(causal, kv_heads):
    q, k, v = arrays(kv_heads)

    def loss(implementation):
        return lambda *qkv: (tk.attention(*qkv, causal=causal, implementation=implementation) ** 2).sum()

    kernel, xla = (tk.attention(q, k, v, causal=causal, implementation=i) for i in ("pallas-interpret", "xla"))
    np.testing.assert_allclose(kernel, xla, atol=2e-6)
    grads = [jax.grad(loss(i), argnums=(0, 1, 2))(q, k, v) for i in ("pallas-interpret", "xla")]
    for ours, theirs in zip(*grads, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=5e-5)
    assert float(jnp.abs(grads[1][1]).max()) > 1e-2  # the keys' gradients are not all zero


class Attend(nn.Module):
    implementation: str

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(32, 32)(tokens)
        b, t, w = x.shape
        q, k, v = (a.reshape(b, t, 4, w // 4) for a in jnp.split(nn.Dense(3 * w)(x), 3, -1))
        x = x + nn.Dense(w)(tk.attention(q, k, v, causal=True, implementation=self.implementation).reshape(b, t, w))
        return nn.Dense(32)(x)


@pytest.mark.parametrize("strategy", ["single", "dp8"])
def test_a_model_written_with_the_kernel_trains_to_xla_attentions_numbers(strategy):
    tokens = np.random.default_rng(1).integers(0, 32, size=(8, 129)).astype(np.int32)
    results = []
    for implementation in ("xla", "pallas-interpret"):
        chosen = tk.DataParallel() if strategy == "dp8" else "single"
        trainer = tk.Trainer(
            Attend(implementation), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.5), strategy=chosen
        )
        history = trainer.fit(tokens[:, :-1], tokens[:, 1:], batch_size=8, epochs=2, shuffle=False, verbose=0)
        results.append((history.history["loss"], jax.tree.leaves(trainer.get_weights())))
    (xla_loss, xla_weights), (kernel_loss, kernel_weights) = results
    np.testing.assert_allclose(kernel_loss, xla_loss, rtol=1e-5)
    assert xla_loss[1] < xla_loss[0]  # it trains
    for ours, theirs in zip(kernel_weights, xla_weights, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-5)


def choose(q, k, implementation=None, platform="tpu", masked=False):
    return attention_kernels.choose(q, k, causal=True, masked=masked, implementation=implementation, platform=platform)


def test_the_choice_per_device_and_shape():
    q = jnp.zeros((1, 512, 8, 128), jnp.bfloat16)
    assert choose(q, q).name == "pallas"
    assert choose(q, q[:, :, :2]).name == "pallas"  # grouped heads: the kernel's multi-query form
    assert choose(q, q, platform="gpu").name == "cudnn"
    assert choose(q.astype(jnp.float32), q, platform="gpu").name == "xla"
    assert choose(q, q, platform="cpu") == attention_kernels.Choice("xla")  # no note: no kernel to miss
    odd = choose(q[:, :500], q[:, :500])
    assert odd.name == "xla" and "length 500 is not a multiple of the Pallas kernel's block of 128" in odd.note
    masked = choose(q, q, masked=True)
    assert masked.name == "xla" and "mask= or bias=" in masked.note
    assert choose(q, q[:, :, :3]).name == "xla"  # 8 heads do not group over 3
    assert attention_kernels.block_size(1024) == 512 and attention_kernels.block_size(384) == 128


def test_an_implementation_that_cannot_run_or_take_the_call_is_refused_by_name():
    q = jnp.zeros((1, 256, 2, 64))
    with pytest.raises(
        ValueError, match=r"implementation='pallas' runs on a TPU, and this program is compiled for 'cpu'"
    ):
        choose(q, q, "pallas", platform="cpu")
    with pytest.raises(ValueError, match=r"implementation='cudnn' runs on a GPU"):
        choose(q, q, "cudnn", platform="tpu")
    with pytest.raises(ValueError, match=r"implementation='flash' is not one of"):
        choose(q, q, "flash")
    with pytest.raises(ValueError, match=r"cannot take this call: length 200 is not a multiple"):
        choose(q[:, :200], q[:, :200], "pallas-interpret", platform="cpu")
    with pytest.raises(ValueError, match=r"runs on a TPU"):  # through tk.attention itself, on this CPU
        tk.attention(q, q, q, causal=True, implementation="pallas")


def test_on_a_cpu_the_default_is_xla_attention_with_its_mask_and_bias():
    q, k, v = arrays(length=64)
    mask = jnp.asarray(np.random.default_rng(2).random((BATCH, 1, 64, 64)) > 0.3)
    bias = jnp.asarray(np.random.default_rng(3).normal(size=(1, HEADS, 64, 64)), jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no note: the CPU has no kernel to route around
        ours = tk.attention(q, k, v, mask=mask, bias=bias)
    theirs = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask)
    np.testing.assert_array_equal(ours, theirs)


class ContextLM(nn.Module):
    """A causal LM of one attention layer over 1,024 positions (a chunk of 256 per device of 4)."""

    implementation: str

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(32, 32)(tokens) + nn.Embed(1024, 32)(jnp.arange(tokens.shape[1]))
        b, t, w = x.shape
        q, k, v = (a.reshape(b, t, 2, w // 2) for a in jnp.split(nn.Dense(3 * w)(x), 3, -1))
        attended = tk.attention(q, k, v, causal=True, implementation=self.implementation)
        return nn.Dense(32)(x + nn.Dense(w)(attended.reshape(b, t, w)))


@pytest.mark.parametrize("length, balanced", [(1024, True), (512, False)])
def test_under_a_context_axis_each_devices_chunk_runs_through_the_kernel_to_single_devices_numbers(length, balanced):
    """Hybrid(data=2, context=4): each device's queries through the kernel against the keys they can see
    (each causal mask offset by its chunk's start), equal to SingleDevice with XLA's attention (SGD). Chunks
    of 256 run balanced (half-chunks d and 7-d of 128 each); chunks of 128, one block, contiguous."""
    tokens = np.random.default_rng(0).integers(0, 32, size=(4, length + 1)).astype(np.int32)
    runs = []
    for implementation, strategy in (("xla", "single"), ("pallas-interpret", tk.Hybrid(data=2, context=4))):
        trainer = tk.Trainer(
            ContextLM(implementation), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.5),
            strategy=strategy,
        )  # fmt: skip
        history = trainer.fit(tokens[:, :-1], tokens[:, 1:], batch_size=2, epochs=1, shuffle=False, verbose=0)
        runs.append((history.history["loss"], jax.tree.leaves(trainer.get_weights())))
    (loss, weights), (their_loss, their_weights) = runs
    np.testing.assert_allclose(their_loss, loss, rtol=1e-5)
    for ours, theirs in zip(their_weights, weights, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-5)
    plan = tk.Trainer(
        ContextLM("pallas-interpret"), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.5)
    ).plan((tokens[:2, :-1], tokens[:2, 1:]), batch_size=2, candidates=[tk.Hybrid(data=2, context=4)], verbose=0)
    assert [(call.door, call.split, call.balanced) for call in plan.rows[0].attention] == [
        ("tk.attention", True, balanced)
    ]


def test_under_a_context_axis_a_chunk_the_kernel_cannot_take_is_refused_naming_the_way_out():
    tokens = np.zeros((2, 256), np.int32)  # chunks of 64 over a context axis of 4
    trainer = tk.Trainer(
        ContextLM("pallas-interpret"), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.5),
        strategy=tk.Hybrid(data=2, context=4),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"chunks of a multiple of 128; received queries of length 256"):
        trainer.fit(tokens, tokens, batch_size=2, epochs=1, verbose=0)
