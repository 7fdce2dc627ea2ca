"""Checkpoints: orbax round trips, other device counts, best-k, manifests, errors, no pickle."""

import logging
import os
import pickle

import jax
import numpy as np
import optax
import pytest
from conftest import MLP, NoisyMLP, make_classification, saved_steps, tree_allclose

import trainkit as tk
from trainkit.callbacks import BackupAndRestore, Callback, ModelCheckpoint


def make(strategy="single", model=None, optimizer=None, **kwargs):
    return tk.Trainer(
        model or NoisyMLP(),
        loss="sparse_categorical_crossentropy",
        optimizer=optimizer or optax.adam(0.01),
        strategy=strategy,
        seed=4,
        **kwargs,
    )


def states_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_save_and_load_restore_the_full_state_and_training_continues_bit_identical(tmp_path):
    x, y = make_classification(96)
    uninterrupted = make(precision="fp16")
    uninterrupted.fit((x, y), batch_size=16, epochs=2, shuffle=False, verbose=0)

    first = make(precision="fp16")
    first.fit((x, y), batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert first.save(tmp_path / "ckpt") == 6
    second = make(precision="fp16")
    second.init(x)
    manifest = second.load(tmp_path / "ckpt")
    states_equal(second.state, first.state)  # params, opt_state, batch_stats, rng, loss scale, step
    assert manifest["position"] == {"epoch": 1, "batch": 0, "global_step": 6}
    assert manifest["strategy"] == "SingleDevice" and manifest["jax_version"] == jax.__version__
    assert manifest["tree"]["params"]["['Dense_0']['kernel']"] == [[5, 16], "float32"]
    second.fit((x, y), batch_size=16, epochs=2, initial_epoch=1, shuffle=False, verbose=0)
    states_equal(second.state.params, uninterrupted.state.params)


MOVES = {
    "dp": lambda: "dp",
    "dp4": lambda: tk.DataParallel(jax.devices()[:4]),
    "single": lambda: tk.SingleDevice(),
    "fsdp": lambda: tk.FSDP(min_shard_size=16),  # the tiny MLP's kernels really are sharded
    "hybrid": lambda: tk.Hybrid(data=2, fsdp=4, min_shard_size=16),
}
WRITTEN_BY = {"dp": "DataParallel on 8 devices", "fsdp": "FSDP on 8 devices", "single": "SingleDevice on 1 devices"}


@pytest.mark.parametrize(
    "source, target", [("dp", "dp4"), ("dp", "single"), ("fsdp", "dp4"), ("fsdp", "single"), ("single", "hybrid")]
)
def test_a_checkpoint_moves_to_another_device_count_or_strategy(tmp_path, source, target, caplog):
    x, y = make_classification(128)
    model, optimizer = MLP(), optax.adam(0.01)
    uninterrupted = make(MOVES[source](), model, optimizer)
    uninterrupted.fit((x, y), batch_size=32, epochs=2, shuffle=False, verbose=0)
    first = make(MOVES[source](), model, optimizer)
    first.fit((x, y), batch_size=32, epochs=1, shuffle=False, verbose=0)
    first.save(tmp_path / "ckpt")
    moved = make(MOVES[target](), model, optimizer)
    moved.init(x)
    with caplog.at_level(logging.WARNING, logger="trainkit"):
        moved.load(tmp_path / "ckpt")
    assert f"written by {WRITTEN_BY[source]}" in caplog.text and "not bit for bit" in caplog.text
    states_equal(moved.state, first.state)  # the restored state itself is exact
    kernel = moved.state.params["Dense_0"]["kernel"]
    assert len(kernel.sharding.device_set) == {"dp4": 4, "single": 1, "hybrid": 8}[target]
    if target == "hybrid":  # restored straight into its shards
        assert kernel.addressable_shards[0].data.shape == (5, 4)
    moved.fit((x, y), batch_size=32, epochs=2, initial_epoch=1, shuffle=False, verbose=0)
    tree_allclose(moved.params, uninterrupted.params, rtol=1e-5, atol=1e-6)


def test_restoring_into_another_model_or_optimizer_names_the_differences(tmp_path):
    x, y = make_classification(32)
    trainer = make(model=MLP(features=16))
    trainer.fit((x, y), batch_size=16, verbose=0)
    trainer.save(tmp_path / "ckpt")
    wider = make(model=MLP(features=24))
    wider.init(x)
    with pytest.raises(
        tk.CheckpointError,
        match=r"params\['Dense_0'\]\['kernel'\]: checkpoint shape \(5, 16\) "
        r"float32, model shape \(5, 24\) float32",
    ):
        wider.load(tmp_path / "ckpt")
    other_optimizer = make(model=MLP(features=16), optimizer=optax.sgd(0.1, momentum=0.9))
    other_optimizer.init(x)
    with pytest.raises(tk.CheckpointError, match=r"opt_state.*in the checkpoint, not in the model"):
        other_optimizer.load(tmp_path / "ckpt")


def test_no_pickle_is_used_to_load_or_stored(tmp_path, monkeypatch):
    x, y = make_classification(32)
    trainer = make()
    trainer.fit((x, y), batch_size=16, verbose=0)
    trainer.save(tmp_path / "ckpt")

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used while loading a checkpoint")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    other = make()
    other.init(x)
    other.load(tmp_path / "ckpt")
    for root, _, files in os.walk(tmp_path / "ckpt"):
        for name in files:
            head = open(os.path.join(root, name), "rb").read(2)
            assert not (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")), name


class FakeValidation(Callback):
    """Logs a controlled val_metric before the checkpoint callback reads it."""

    def __init__(self, values):
        self.values = iter(values)

    def on_epoch_end(self, epoch, logs=None):
        logs["val_metric"] = next(self.values)


def test_model_checkpoint_keeps_the_best_k(tmp_path):
    x, y = make_classification(32)
    values = [0.9, 0.5, 0.7, 0.4, 0.45, 0.3]  # improvements at epochs 0, 1, 3, 5
    checkpoint = ModelCheckpoint(
        tmp_path / "best", monitor="val_metric", mode="min", save_best_only=True, max_to_keep=2
    )
    trainer = make()
    trainer.fit((x, y), batch_size=16, epochs=6, verbose=0, callbacks=[FakeValidation(values), checkpoint])
    # a fixed path keeps the newest max_to_keep saves; with save_best_only those are the best
    assert saved_steps(tmp_path / "best") == [8, 12]  # epochs 3 and 5 (2 steps per epoch)


def test_model_checkpoint_keeps_the_latest_and_saves_every_n_steps(tmp_path):
    x, y = make_classification(64)
    checkpoint = ModelCheckpoint(tmp_path / "latest", max_to_keep=3, save_freq=3)
    trainer = make()
    trainer.fit((x, y), batch_size=16, epochs=3, verbose=0, callbacks=[checkpoint])
    assert saved_steps(tmp_path / "latest") == [6, 9, 12]


def test_a_non_finite_loss_is_never_checkpointed(tmp_path):
    x, y = make_classification(32)
    x = x.copy()
    x[20] = np.inf
    checkpoint = ModelCheckpoint(tmp_path / "nan", monitor="loss")
    trainer = make()
    with pytest.warns(UserWarning, match="not saving step 2 to .*: the loss is nan") as caught:
        trainer.fit((x, y), batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[checkpoint])
    assert saved_steps(tmp_path / "nan") == []
    # every warning (the loop's and the callback's) points at the user's fit call, not trainkit's lines
    assert {w.filename for w in caught} == {__file__}, [(w.filename, w.lineno) for w in caught]


def test_unwritable_directory_is_reported_before_training(tmp_path):
    x, y = make_classification(32)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    trainer = make()
    with pytest.raises(tk.CheckpointError, match=f"Cannot write checkpoints to '{blocker}/ckpt'"):
        trainer.fit((x, y), batch_size=16, verbose=0, callbacks=[ModelCheckpoint(blocker / "ckpt")])
    assert int(trainer.state.step) == 0  # nothing trained, nothing lost


def test_a_full_disk_raises_naming_the_directory_and_loses_nothing(tmpfs, tmp_path):
    small_disk = tmpfs
    x, y = make_classification(32)

    class FillDisk(Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:  # once the first checkpoint is on disk, fill the disk
                checkpoint.wait()
                try:
                    with open(small_disk / "filler", "wb") as f:
                        while True:
                            f.write(b"\0" * 65536)
                except OSError:  # full (possibly already before the first byte)
                    pass

    checkpoint = ModelCheckpoint(small_disk / "ckpt", monitor="loss")
    trainer = make()
    with pytest.raises(
        tk.CheckpointError,
        match=rf"Writing a checkpoint to '{small_disk}/ckpt' failed.*"
        r"last complete checkpoint is step 2",
    ):
        trainer.fit((x, y), batch_size=16, epochs=4, verbose=0, callbacks=[checkpoint, FillDisk()])
    # reported at the first batch after the failed write (step 4), or at the latest when the next
    # save waits for it (step 6): not at the end of fit (step 8)
    assert 4 <= int(trainer.state.step) <= 6  # the state in memory is intact and can be saved elsewhere
    trainer.save(tmp_path / "elsewhere")
    if (small_disk / "filler").exists():
        os.remove(small_disk / "filler")
    restored = make()
    restored.init(x)
    assert restored.load(small_disk / "ckpt")["position"]["global_step"] == 2


def test_backup_and_restore_converts_the_position_for_another_batch_size(tmp_path, caplog):
    x, y = make_classification(64)

    class Interrupt(Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.trainer.global_step >= 4:
                raise KeyboardInterrupt

    trainer = make()
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(
            (x, y),
            batch_size=8,
            epochs=2,
            verbose=0,
            callbacks=[BackupAndRestore(tmp_path / "backup", save_freq=2), Interrupt()],
        )
    resumed = make()
    with caplog.at_level(logging.INFO, logger="trainkit"):
        resumed.fit(
            (x, y), batch_size=16, epochs=2, verbose=0, callbacks=[BackupAndRestore(tmp_path / "backup", save_freq=2)]
        )
    assert "written with batch_size=8, this run uses 16" in caplog.text
    assert "resuming from step 2 (epoch 0, batch 1)" in caplog.text  # 2 batches of 8 = 1 of 16
    assert int(resumed.state.step) == 2 + 3 + 4  # the rest of epoch 0, then epoch 1
    assert not (tmp_path / "backup").exists()  # deleted once training completed


def test_a_fixed_model_checkpoint_path_is_replaced_only_when_saving(tmp_path):
    x, y = make_classification(64)
    path = tmp_path / "model"
    first = make()
    first.fit((x, y), batch_size=16, epochs=2, verbose=0, callbacks=[ModelCheckpoint(path, monitor="loss")])
    assert saved_steps(path) == [8]

    class FailAtOnce(Callback):
        def on_train_batch_begin(self, batch, logs=None):
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):  # opening the path deletes nothing
        make().fit((x, y), batch_size=16, verbose=0, callbacks=[ModelCheckpoint(path, monitor="loss"), FailAtOnce()])
    assert saved_steps(path) == [8]
    second = make()
    second.fit((x, y), batch_size=16, epochs=1, verbose=0, callbacks=[ModelCheckpoint(path, monitor="loss")])
    assert saved_steps(path) == [4]  # the newer-by-step file of the first run was replaced
    reader = make()
    reader.init(x)
    reader.load(path)
    tree_allclose(reader.get_weights(), second.get_weights(), rtol=0, atol=0)
