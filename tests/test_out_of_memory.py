"""A step that does not fit the device's memory, named (issue #68). On a CPU the device's memory is
set with ``TRAINKIT_DEVICE_MEMORY`` (a chip's limit rehearsed on the plan): ``fit``'s first train
step is compiled before it runs, and a step above the limit is refused with the bytes, the largest
batch that fits and the memory measure that makes this batch fit, each found by compiling. Nothing
is lost: the same trainer then fits at the named batch, to the numbers of a trainer that never met
the error. The device's own error (XLA's ``RESOURCE_EXHAUSTED``, which a TPU's compiler raises) is
named the same way by the loop (tested for ``predict``; ``evaluate`` and ``fit`` pass the same door)."""

import jax
import numpy as np
import optax
import pytest
from conftest import tree_allclose
from flax import linen as nn
from jax._src import dispatch

import trainkit as tk
from trainkit.program import out_of_memory


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(128)(nn.relu(nn.Dense(512)(x)))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(128)(x)
        for _ in range(3):
            x = Block()(x)
        return nn.Dense(4)(x)


@pytest.fixture(scope="module")
def rows():
    x = np.random.default_rng(0).normal(size=(1024, 32)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32)


def make():
    return tk.Trainer(Net(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3), strategy="single")


def step_bytes(x, y, batch_size) -> int:
    return make().plan((x[:batch_size], y[:batch_size]), candidates=[tk.SingleDevice()], verbose=0).rows[0].total_bytes


def test_a_train_step_above_the_memory_is_named_with_what_fits_and_nothing_is_lost(rows, monkeypatch):
    x, y = rows
    half, whole = step_bytes(x, y, 256), step_bytes(x, y, 512)
    monkeypatch.setenv(out_of_memory.MEMORY_VARIABLE, str((half + whole) // 2))
    trainer = make()
    with pytest.raises(tk.OutOfMemory) as info:
        trainer.fit(x, y, batch_size=512, epochs=1, verbose=0)
    error = info.value
    assert (error.kind, error.batch_size, error.fits_at, error.measure) == ("train", 512, 256, "remat")
    assert error.needed == whole and error.available == (half + whole) // 2
    text = str(error)
    assert "batch_size=256 fits" in text and "Trainer(remat=" in text and "bf16 parameters" in text
    assert "Nothing was run" in text
    history = trainer.fit(x, y, batch_size=error.fits_at, epochs=2, verbose=0, shuffle=False)
    fresh = make()
    expected = fresh.fit(x, y, batch_size=256, epochs=2, verbose=0, shuffle=False)
    assert history.history["loss"] == expected.history["loss"]
    tree_allclose(trainer.params, fresh.params, rtol=0, atol=0)


def test_a_step_that_fits_is_compiled_once_and_run(rows, monkeypatch):
    x, y = rows
    monkeypatch.setenv(out_of_memory.MEMORY_VARIABLE, "1GiB")
    compiled: list[str] = []

    def listener(event, duration=None, **kwargs):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            compiled.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        make().fit(x, y, batch_size=128, epochs=1, verbose=0)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len([name for name in compiled if "train" in name]) == 1, compiled  # the plan's, which the loop ran


def test_the_memory_setting_is_checked(monkeypatch):
    monkeypatch.setenv(out_of_memory.MEMORY_VARIABLE, "lots")
    with pytest.raises(ValueError, match="TRAINKIT_DEVICE_MEMORY must be a positive number of bytes"):
        out_of_memory.known_limit(jax.devices())


class RefusedByTheChip(tk.SingleDevice):
    """A stand-in for a TPU's compiler, which refuses a program above its memory at the first call
    with this error (its text as the chip printed it for a 12 x 1,024 LM at batch 512): predict
    calls of more than 64 rows are refused; planning (lowering) is the real one. A CPU cannot raise
    it safely: XLA's CPU client aborts the process when a failed allocation's output is read."""

    def compile(self, kind, fn, abstract_state):
        compiled = super().compile(kind, fn, abstract_state)
        return Refusing(compiled) if kind == "predict" else compiled


class Refusing:
    def __init__(self, compiled):
        self.compiled = compiled

    def lower(self, *arguments):
        return self.compiled.lower(*arguments)

    def __call__(self, state, batch):
        if jax.tree.leaves(batch)[0].shape[0] > 64:
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 82.58G of 15.75G hbm. "
                "Exceeded hbm capacity by 66.83G."
            )
        return self.compiled(state, batch)


def test_the_device_s_own_out_of_memory_error_is_named_for_predict(rows):
    x, y = rows
    trainer = tk.Trainer(Net(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3),
                         strategy=RefusedByTheChip())  # fmt: skip
    with pytest.raises(tk.OutOfMemory) as info:
        trainer.predict(x, batch_size=512)
    error = info.value
    assert isinstance(error.__cause__, jax.errors.JaxRuntimeError)
    assert error.kind == "predict" and error.needed == out_of_memory.bytes_in_message(str(error.__cause__))
    assert "needs 82.58 GiB per device" in str(error) and "batch_size=" in str(error)
    assert "the trainer's state is whole" in str(error)
    assert trainer.predict(x[:64], batch_size=64).shape == (64, 4)


def test_find_batch_size_says_and_takes_its_headroom(rows):
    x, y = rows
    limit = step_bytes(x, y, 512) + step_bytes(x, y, 256) // 8
    kept = make().find_batch_size(x, y, max_batch_size=512, memory_limit=limit, verbose=0)
    tight = make().find_batch_size(x, y, max_batch_size=512, memory_limit=limit, verbose=0, headroom=0.0)
    assert (kept.batch_size, tight.batch_size) == (256, 512)
    assert "a headroom of 10% kept free" in str(kept) and "a headroom of 0% kept free" in str(tight)
    with pytest.raises(ValueError, match="headroom must be a fraction"):
        make().find_batch_size(x, y, memory_limit=limit, headroom=10, verbose=0)
