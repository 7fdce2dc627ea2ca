"""Reporting to Ray Train, the parts that run without a Ray worker: RayTrainReport's arguments and
refusal outside a worker, the callback list that adds it, BackupAndRestore's backup on demand
(Ray's preemption notice), and the checkpoint names that tie a Ray checkpoint to its backup
folder. Under a real Ray head: tests/engines (``make test-engines``)."""

import flax.linen as nn
import optax
import pytest
from conftest import saved_steps

import trainkit as tk
from trainkit.callbacks import BackupAndRestore, LambdaCallback, RayTrainReport
from trainkit.callbacks.callback_list import with_ray_report
from trainkit.distributed import ray_train


def make():
    """A logistic regression for the suite's shared data (conftest's ``data``: 100 rows, 3 classes)."""
    return tk.Trainer(nn.Dense(3), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single")


@pytest.mark.parametrize("seconds", [-1, True, "5", float("nan")])
def test_check_seconds_must_be_a_number_of_seconds(seconds):
    with pytest.raises(ValueError, match=r"RayTrainReport\(check_seconds=...\) must be a number of seconds >= 0"):
        RayTrainReport(check_seconds=seconds)


def test_outside_a_ray_worker_the_report_refuses_before_the_first_step(data):
    trainer = make()
    with pytest.raises(RuntimeError, match="does not run inside a Ray Train worker.*Remove it"):
        trainer.fit(*data, batch_size=8, epochs=1, verbose=0, callbacks=[RayTrainReport()])
    assert trainer.global_step == 0


def test_the_list_of_a_ray_fit_reports_its_one_backup(tmp_path):
    backup = BackupAndRestore(tmp_path / "b")
    listed = with_ray_report([backup])
    assert isinstance(listed[-1], RayTrainReport) and listed[-1].backup is backup and listed[0] is backup
    own = RayTrainReport(check_seconds=1)
    assert with_ray_report([own, backup]) == [own, backup] and own.backup is backup  # the user's, attached
    assert with_ray_report([])[0].backup is None  # metrics only
    with pytest.raises(ValueError, match="2 BackupAndRestore callbacks.*Keep one"):
        with_ray_report([backup, BackupAndRestore(tmp_path / "c")])


def test_backup_now_writes_the_current_step_once_and_waits(data, tmp_path):
    """What Ray's preemption notice asks: a backup at once (here at step 3 of an epoch whose
    backups are at epoch ends), on disk when it returns; asked again at the same step, nothing new."""
    saver = BackupAndRestore(tmp_path / "backup", delete_checkpoint=False)
    written = []

    def now(batch, logs=None):
        if batch == 3:
            written.extend([saver.backup_now(), saver.backup_now(), saver.last_backup])
            written.append(saved_steps(tmp_path / "backup"))

    trainer = make()
    trainer.fit(*data, batch_size=8, epochs=1, verbose=0, callbacks=[saver, LambdaCallback(on_train_batch_begin=now)])
    assert written == [3, 3, 3, [3]]
    assert saver.written() == 13 and saved_steps(tmp_path / "backup") == [13]  # the epoch end's replaced it


def test_a_ray_checkpoint_belongs_to_the_backup_folder_of_its_name(tmp_path):
    name = ray_train.checkpoint_name(str(tmp_path / "runs" / "dp"), 12)
    assert name == "trainkit-dp-step-12"
    assert ray_train.step_of(name, "/elsewhere/dp/") == 12  # a fresh machine's folder of that name
    assert ray_train.step_of(name, str(tmp_path / "fsdp")) is None
    assert ray_train.step_of("checkpoint_2026-12-03", str(tmp_path / "dp")) is None  # not trainkit's
    assert ray_train.step_of(ray_train.checkpoint_name("/a/my-step-run", 3), "/b/my-step-run") == 3
