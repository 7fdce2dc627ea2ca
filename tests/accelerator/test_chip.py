"""trainkit on the chip (issue #68), one process: the built-in and a custom step against this
process's CPU under ``jax.default_matmul_precision("highest")``; bf16 and fp16 policies; remat and
offload with the same numbers; a run stopped mid-epoch and resumed bit-exact; an export read back;
``find_batch_size``'s answer runs; a step above the chip's memory is named, and the same trainer
then fits at the named batch. Every trainer here lives on ``chip`` (the first device) unless
placed on ``host_cpu`` for the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import trainkit as tk
from trainkit.program import out_of_memory


class MLP(nn.Module):
    width: int = 64

    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(4)(x)


@pytest.fixture(scope="module")
def rows():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 16)).astype(np.float32)
    return x, (x[:, 0] + x[:, 1] > 0).astype(np.int32)


def trainer_on(device, trainer_class=tk.Trainer, **options):
    return trainer_class(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3),
                         strategy=tk.SingleDevice(device), **options)  # fmt: skip


def assert_close(ours, reference, rtol):
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol, atol=rtol)


class OwnStep(tk.Trainer):
    """A custom step: the built-in loss by hand, through the helpers a user step calls."""

    def train_step(self, state, batch, rng):
        def loss_fn(params):
            logits, _ = state.apply(params, state.model_state, batch["x"], rng=rng, train=True)
            return state.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), batch)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads), {"loss": loss}


@pytest.mark.parametrize("trainer_class", [tk.Trainer, OwnStep], ids=["built-in", "custom"])
def test_the_chip_trains_to_the_cpu_s_numbers(rows, chip, host_cpu, trainer_class):
    x, y = rows
    fits = {}
    with jax.default_matmul_precision("highest"):
        for name, device in (("chip", chip), ("cpu", host_cpu)):
            trainer = trainer_on(device, trainer_class)
            history = trainer.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
            fits[name] = (history.history["loss"], trainer.params)
    np.testing.assert_allclose(fits["chip"][0], fits["cpu"][0], rtol=1e-4)
    assert_close(fits["chip"][1], fits["cpu"][1], rtol=1e-4)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_policies_train(rows, chip, precision):
    x, y = rows
    trainer = trainer_on(chip, precision=precision)
    losses = trainer.fit(x, y, batch_size=64, epochs=4, verbose=0).history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.parametrize("options", [{"remat": "full"}, {"offload": "optimizer"}], ids=["remat", "offload"])
def test_memory_measures_keep_the_numbers(rows, chip, options):
    x, y = rows
    plain, measured = trainer_on(chip), trainer_on(chip, **options)
    for trainer in (plain, measured):
        trainer.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    assert_close(measured.params, plain.params, rtol=1e-5)


class StopAt(tk.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if self.model.global_step == self.step:
            raise RuntimeError("stopped")


def test_a_run_stopped_mid_epoch_resumes_bit_exact(rows, chip, tmp_path):
    x, y = rows
    straight = trainer_on(chip)
    straight.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    backup = tk.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=3)
    with pytest.raises(RuntimeError, match="stopped"):
        trainer_on(chip).fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0, callbacks=[backup, StopAt(11)])
    resumed = trainer_on(chip)
    backup = tk.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=3)
    resumed.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0, callbacks=[backup])
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(straight.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_export_reads_back_with_predict_s_outputs(rows, chip, tmp_path):
    x, y = rows
    trainer = trainer_on(chip)
    trainer.fit(x, y, batch_size=64, epochs=1, verbose=0)
    with jax.default_matmul_precision("highest"):  # an export keeps the precision it was traced with: the same here
        trainer.export(tmp_path / "model.jax", verbose=False)
        loaded = tk.export.load(tmp_path / "model.jax")
        np.testing.assert_allclose(np.asarray(loaded(x[:7])), trainer.predict(x[:7]), rtol=1e-4, atol=1e-4)


def chip_memory(chip) -> int:
    return out_of_memory.known_limit([chip]) or 0


@pytest.fixture
def rehearsed(monkeypatch, chip):
    """The chip's memory, or on a CPU rehearsal a small one (``TRAINKIT_DEVICE_MEMORY``), and a
    model and batch sized to need about twice it per step."""
    if chip.platform == "cpu":
        monkeypatch.setenv(out_of_memory.MEMORY_VARIABLE, "64MiB")
    limit = chip_memory(chip)
    width = 16384 if limit > 2**32 else 256
    per_row = 4 * width * 4  # two activations of the width, and their gradients, in float32
    batch = 1 << max(6, int(2 * limit / per_row).bit_length())
    return limit, width, batch


def wide_trainer(chip, width):
    return tk.Trainer(MLP(width=width), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(1e-3),
                      strategy=tk.SingleDevice(chip))  # fmt: skip


def test_find_batch_size_answers_a_batch_that_runs(chip, rehearsed):
    limit, width, batch = rehearsed
    x = np.ones((batch, 16), np.float32)
    y = np.zeros(batch, np.int32)
    found = wide_trainer(chip, width).find_batch_size(x, y, max_batch_size=batch, verbose=0)
    assert found.batch_size & (found.batch_size - 1) == 0 and found.batch_size < batch
    assert f"a headroom of {found.headroom:.0%} kept free" in str(found)
    runs = wide_trainer(chip, width).fit(x, y, batch_size=found.batch_size, steps_per_epoch=1, verbose=0)
    assert np.isfinite(runs.history["loss"][0])


def test_a_step_above_the_chip_s_memory_is_named_and_the_named_batch_fits(chip, rehearsed):
    limit, width, batch = rehearsed
    x = jnp.ones((batch, 16), jnp.float32)
    y = np.zeros(batch, np.int32)
    x = np.asarray(x)
    trainer = wide_trainer(chip, width)
    with pytest.raises(tk.OutOfMemory) as info:
        trainer.fit(x, y, batch_size=batch, verbose=0)
    error = info.value
    print(f"\nthe named error on {chip.device_kind}:\n{error}")
    assert error.available == limit and error.fits_at is not None and error.fits_at < batch
    history = trainer.fit(x, y, batch_size=error.fits_at, steps_per_epoch=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_tk_attention_runs_the_pallas_kernel_within_bf16_of_float32_xla_attention(chip):
    """#71: on a TPU, ``implementation=None`` picks the splash kernel for a causal call of length 2,048;
    its outputs and gradients in bf16 are within 3e-2 of XLA attention's in float32."""
    if chip.platform != "tpu":
        pytest.skip("the Pallas kernel runs on a TPU")
    from trainkit.attn import kernels as attention_kernels

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 2048, 8, 128)), jnp.float32) for _ in range(3))
    assert (
        attention_kernels.choose(q, k, causal=True, masked=False, implementation=None, platform="tpu").name == "pallas"
    )

    def loss(implementation, dtype):
        def f(*qkv):
            out = tk.attention(*(a.astype(dtype) for a in qkv), causal=True, implementation=implementation)
            return (out.astype(jnp.float32) ** 2).mean()

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

    with jax.default_matmul_precision("highest"):
        reference = loss("xla", jnp.float32)(q, k, v)
    kernel = loss(None, jnp.bfloat16)(q, k, v)
    for ours, theirs in zip(jax.tree.leaves(kernel), jax.tree.leaves(reference), strict=True):
        scale = float(jnp.abs(theirs).max())
        assert float(jnp.abs(ours.astype(jnp.float32) - theirs).max()) <= 3e-2 * max(scale, 1.0)


def kernel_against_xla(q, k, v, implementation, **options):
    """The largest difference of ``tk.attention``'s outputs and gradients under ``implementation`` in bf16 from
    XLA attention's in float32 (``options``: segment ids, a window), each over the reference's largest value."""

    def loss(implementation, dtype):
        def f(*qkv):
            out = tk.attention(*(a.astype(dtype) for a in qkv), causal=True, implementation=implementation, **options)
            return (out.astype(jnp.float32) ** 2).mean()

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

    with jax.default_matmul_precision("highest"):
        reference = loss("xla", jnp.float32)(q, k, v)
    ours = loss(implementation, jnp.bfloat16)(q, k, v)
    return max(
        float(jnp.abs(a.astype(jnp.float32) - b).max()) / max(float(jnp.abs(b).max()), 1.0)
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(reference), strict=True)
    )


def feature_inputs(feature, length, seed=0):
    """Queries, keys and values ``(1, length, 8, 128)`` (grouped: keys and values of 2 heads) and the options of
    ``feature``: three packed documents' segment ids, a sliding window of 256 keys, or grouped heads."""
    rng = np.random.default_rng(seed)
    kv_heads = 2 if feature == "grouped" else 8
    q = jnp.asarray(rng.normal(size=(1, length, 8, 128)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, length, kv_heads, 128)), jnp.float32) for _ in range(2))
    options = {}
    if feature == "segment_ids":
        cuts = np.searchsorted([length * 0.35, length * 0.75], np.arange(length), side="right")
        options["segment_ids"] = jnp.asarray(cuts[None] + 1, jnp.int32)
    if feature == "window":
        options["window"] = (length // 8, 0)
    return q, k, v, options


@pytest.mark.parametrize("feature", ["segment_ids", "window", "grouped"])
def test_the_kernel_s_segment_ids_window_and_grouped_heads_match_xla_within_bf16(chip, feature):
    """#83: on a TPU the splash kernel's packed documents (segment ids), sliding window and grouped heads (8 query
    heads over 2 key/value heads) give XLA attention's float32 outputs and gradients within bf16's 3e-2, at 2,048
    tokens, causal."""
    if chip.platform != "tpu":
        pytest.skip("the Pallas kernel runs on a TPU")
    q, k, v, options = feature_inputs(feature, 2048)
    assert kernel_against_xla(q, k, v, None, **options) <= 3e-2
