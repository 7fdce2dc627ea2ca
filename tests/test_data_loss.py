"""trainkit never deletes a file it did not write, and never writes a "cloud" path as a local
folder (#59): each test puts the user's files beside the target and checks every one survives."""

import os

import flax.linen as nn
import numpy as np
import optax
import pytest
from conftest import make_classification

import trainkit as tk
from trainkit.distributed import atomic

X, Y = make_classification(64)


def trainer():
    return tk.Trainer(nn.Dense(3), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single")


def user_files(folder):
    """Two files of the user's in ``folder`` (one in a subfolder); their contents by path."""
    os.makedirs(folder / "mine", exist_ok=True)
    files = {folder / "notes.txt": "keep me", folder / "mine" / "data.csv": "1,2,3"}
    for path, text in files.items():
        path.write_text(text)
    return files


def assert_survived(files):
    for path, text in files.items():
        assert path.read_text() == text, path


@pytest.mark.parametrize("target", [".", ""], ids=["dot", "empty"])
def test_export_to_the_working_directory_is_refused(tmp_path, monkeypatch, target):
    files = user_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    model = trainer()
    model.fit(X, Y, batch_size=16, verbose=0)
    with pytest.raises(FileExistsError, match=r"is the working directory .*Name a new file or folder"):
        model.export(target, verbose=False)
    assert_survived(files)


def test_a_folder_output_replaces_an_earlier_one_but_never_a_folder_of_other_files(tmp_path):
    def write(folder):
        with atomic.staged(folder, folder_entries={"saved_model.pb", "variables"}) as temporary:
            os.makedirs(os.path.join(temporary, "variables"))
            open(os.path.join(temporary, "saved_model.pb"), "w").write("new")

    write(tmp_path / "export")
    write(tmp_path / "export")  # an earlier export of its own: replaced
    assert (tmp_path / "export" / "saved_model.pb").read_text() == "new"
    files = user_files(tmp_path / "project")
    with pytest.raises(FileExistsError, match=r"holds files this output does not have \(mine, notes.txt\)"):
        write(tmp_path / "project")
    assert_survived(files)
    assert sorted(os.listdir(tmp_path / "project")) == ["mine", "notes.txt"]  # nothing written there


def test_a_tf_saved_model_export_onto_a_folder_of_the_users_is_refused(tmp_path):
    pytest.importorskip("tensorflow")
    files = user_files(tmp_path / "served")
    model = trainer()
    model.fit(X, Y, batch_size=16, verbose=0)
    with pytest.raises(FileExistsError, match=r"holds files this output does not have"):
        model.export(tmp_path / "served", format="tf_saved_model", verbose=False)
    assert_survived(files)
    model.export(tmp_path / "fresh", format="tf_saved_model", verbose=False)
    model.export(tmp_path / "fresh", format="tf_saved_model", verbose=False)  # its own export: replaced
    assert (tmp_path / "fresh" / "saved_model.pb").exists()


def test_backup_and_restore_refuses_a_folder_of_other_files_before_training(tmp_path):
    files = user_files(tmp_path / "backup")
    model = trainer()
    with pytest.raises(
        tk.CheckpointError, match=r"holds files it did not write \(mine, notes.txt\).*folder of its own"
    ):
        model.fit(
            X, Y, batch_size=16, epochs=2, verbose=0, callbacks=[tk.callbacks.BackupAndRestore(tmp_path / "backup")]
        )
    assert model.global_step == 0
    assert_survived(files)


def test_backup_and_restore_in_the_working_directory_is_refused_when_it_holds_the_users_files(tmp_path, monkeypatch):
    files = user_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(tk.CheckpointError, match=r"holds files it did not write"):
        trainer().fit(X, Y, batch_size=16, verbose=0, callbacks=[tk.callbacks.BackupAndRestore(".")])
    assert_survived(files)


def test_backup_and_restore_deletes_only_its_backups_when_the_fit_completes(tmp_path):
    backup = tmp_path / "backup"

    class AddsAFile(tk.callbacks.Callback):  # the user writes into the folder while the run goes on
        def on_epoch_end(self, epoch, logs=None):
            (backup / "written-meanwhile.txt").write_text("mine")

    callbacks = [tk.callbacks.BackupAndRestore(backup, save_freq=2), AddsAFile()]
    trainer().fit(X, Y, batch_size=16, epochs=2, verbose=0, callbacks=callbacks)
    assert os.listdir(backup) == ["written-meanwhile.txt"]
    trainer().fit(X, Y, batch_size=16, epochs=1, verbose=0, callbacks=[tk.callbacks.BackupAndRestore(tmp_path / "b")])
    assert not (tmp_path / "b").exists()  # its own folder, emptied of its backups: removed


URL = "gs://alice:s3cr3t@bucket/run"


@pytest.mark.parametrize(
    "act",
    [
        lambda model: model.save(URL),
        lambda model: model.save_weights(URL + "/w.safetensors"),
        lambda model: model.export(URL + "/m.jax", verbose=False),
        lambda model: model.load(URL),
        lambda model: tk.weights.load(URL, into=model),
        lambda model: tk.callbacks.BackupAndRestore(URL),
        lambda model: tk.callbacks.ModelCheckpoint(URL + "/{epoch}"),
        lambda model: model.save("s3://bucket/run"),
    ],
    ids=["save", "save_weights", "export", "load", "weights_load", "backup", "model_checkpoint", "s3"],
)
def test_a_url_is_refused_naming_the_mount_and_never_printing_its_password(tmp_path, monkeypatch, act):
    monkeypatch.chdir(tmp_path)
    model = trainer()
    model.fit(X, Y, batch_size=16, verbose=0)
    with pytest.raises(
        ValueError, match=r"(gs|s3):// URL, which trainkit does not read or write.*Mount the bucket"
    ) as e:
        act(model)
    assert "s3cr3t" not in str(e.value) and os.listdir(tmp_path) == []  # nothing written as a local 'gs:' folder


def test_weights_from_an_orbax_tree_with_entries_left_out_load(tmp_path):
    """#59's repro: keep_initial= (an entry skipped) crashed in orbax with "Unsupported type: ellipsis"."""
    import orbax.checkpoint as ocp

    model = trainer()
    model.init((X, Y))
    saved = {"kernel": np.full((5, 3), 2.0, np.float32), "bias": np.full((3,), 7.0, np.float32)}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "tree", saved)
    checkpointer.wait_until_finished()
    before = np.asarray(model.params["bias"])
    report = tk.weights.load(tmp_path / "tree", into=model, keep_initial=[r"^bias$"])
    assert report.loaded == ("kernel",)
    np.testing.assert_array_equal(model.params["kernel"], saved["kernel"])
    np.testing.assert_array_equal(model.params["bias"], before)


def test_a_checkpoints_state_folder_is_not_offered_its_optimizer_moments_as_weights(tmp_path):
    """#59: the rename hint for a trainkit ``state`` folder suggested ``rename=[('^opt_state/0/mu/', '')]``."""
    model = trainer()
    model.init((X, Y))
    model.save(tmp_path / "ck")
    with pytest.raises(tk.weights.WeightFileError, match=r"is a trainkit checkpoint") as error:
        tk.weights.load(tmp_path / "ck" / "0" / "state", into=model)
    assert "opt_state" not in str(error.value)
    zeros = {"fc": {name: np.zeros_like(value) for name, value in model.params.items()}}
    loaded = tk.weights.load(tmp_path / "ck" / "0" / "state", into=zeros, prefix="fc/")  # its variables, by prefix
    assert loaded.report.loaded == ("bias", "kernel")
    np.testing.assert_array_equal(loaded.tree["fc"]["kernel"], model.params["kernel"])


def test_an_output_under_a_file_names_the_file(tmp_path):
    (tmp_path / "afile").write_text("mine")
    model = trainer()
    model.fit(X, Y, batch_size=16, verbose=0)
    with pytest.raises(NotADirectoryError, match=r"lies under .*afile'.*which is a file, not a folder"):
        model.export(tmp_path / "afile" / "m.jax", verbose=False)
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.parametrize(
    ("rule", "message"),
    [((r"a", r"\2"), "invalid group reference"), ((r"(a)", r"\q"), "bad escape")],
    ids=["group", "escape"],
)
def test_a_rename_with_a_bad_replacement_names_the_pair(rule, message):
    model = trainer()
    model.init((X, Y))
    with pytest.raises(ValueError, match=rf"rename pair .* is not a valid re.sub pattern and replacement \({message}"):
        tk.weights.load({"kernel": np.zeros((5, 3), np.float32)}, into=model, rename=[rule], strict=False)


def test_weights_holding_nan_are_loaded_and_said(tmp_path):
    model = trainer()
    model.init((X, Y))
    kernel = np.zeros((5, 3), np.float32)
    kernel[1, 2] = np.nan
    with pytest.warns(UserWarning, match=r"holds NaN or Inf in bias, kernel: loaded as they are"):
        report = tk.weights.load({"kernel": kernel, "bias": np.full(3, np.inf, np.float32)}, into=model)
    assert report.non_finite == ("bias", "kernel") and "holding NaN or Inf" in str(report)


@pytest.mark.parametrize(
    "journal",
    ['{"step": "12", "ledger": {}}', '{"step": 12}', '{"step": 12, "ledger": {"wall_seconds": NaN}}', "[1, 2]"],
    ids=["string_step", "no_ledger", "nan_seconds", "a_list"],
)
def test_a_goodput_journal_of_the_wrong_types_is_named_and_the_resume_goes_on(tmp_path, journal):
    backup = tmp_path / "backup"

    class Stop(tk.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.global_step == 3:
                raise KeyboardInterrupt  # an interrupted run: its backup stays

    with pytest.raises(KeyboardInterrupt):
        trainer().fit(X, Y, batch_size=16, epochs=2, verbose=0,
                      callbacks=[tk.callbacks.BackupAndRestore(backup, save_freq=1), Stop()])  # fmt: skip
    (backup / "goodput.json").write_text(journal)
    resumed = trainer()
    with pytest.warns(UserWarning, match=r"goodput.json (has|holds) .*the resume itself is unaffected"):
        resumed.fit(X, Y, batch_size=16, epochs=2, verbose=0, callbacks=[tk.callbacks.BackupAndRestore(backup)])
    assert resumed.global_step == 8


def test_an_npz_member_no_variable_asks_for_is_never_read(tmp_path, monkeypatch):
    """#59: a .npz with an unused large entry cost its whole size in memory."""
    np.savez(tmp_path / "w.npz", kernel=np.ones((5, 3), np.float32), unused=np.zeros((256, 1024), np.float32))
    read = []
    original = np.lib.npyio.NpzFile.__getitem__
    monkeypatch.setattr(np.lib.npyio.NpzFile, "__getitem__", lambda self, key: read.append(key) or original(self, key))
    model = trainer()
    model.init((X, Y))
    report = tk.weights.load(tmp_path / "w.npz", into=model, strict=False)
    assert report.loaded == ("kernel",) and "unused" in report.unexpected
    assert read == ["kernel"]


def test_a_slow_trainable_callable_is_asked_once_per_leaf_and_its_errors_are_its_own():
    asked = []

    def trains(path, leaf):
        asked.append(path)
        return path.startswith("kernel")

    model = tk.Trainer(nn.Dense(3), loss="sparse_categorical_crossentropy", optimizer=optax.adam(0.1),
                       strategy="single", trainable=trains)  # fmt: skip
    model.fit(X, Y, batch_size=16, epochs=2, verbose=0)
    assert sorted(asked) == ["bias", "kernel"]  # #59: 15 times per leaf per fit before

    def broken(path, leaf):
        raise KeyError("layer")

    with pytest.raises(ValueError, match=r"The trainable= callable raised KeyError for the parameter 'bias'"):
        tk.Trainer(nn.Dense(3), loss="sparse_categorical_crossentropy", optimizer=optax.adam(0.1), strategy="single",
                   trainable=broken).fit(X, Y, batch_size=16, verbose=0)  # fmt: skip


def test_gradient_stats_given_a_file_for_its_folder_refuses_before_the_first_step(tmp_path):
    pytest.importorskip("tensorboardX")
    (tmp_path / "afile").write_text("mine")
    model = trainer()
    with pytest.raises(ValueError, match=r"GradientStats\(log_dir=.*afile'\) cannot be written"):
        model.fit(
            X, Y, batch_size=16, verbose=0, callbacks=[tk.callbacks.GradientStats(every=1, log_dir=tmp_path / "afile")]
        )
    assert model.global_step == 0 and (tmp_path / "afile").read_text() == "mine"


def test_a_re_export_whose_final_rename_fails_leaves_the_old_pair_whole(tmp_path, monkeypatch):
    """#59: the new sidecar was moved first, so a failed rename of the model left the old model with
    the new sidecar: refused as damaged. Now either the old pair or the new one is whole."""
    first = trainer()
    first.fit(X, Y, batch_size=16, verbose=0)
    first.export(tmp_path / "m.jax", verbose=False)
    expected = tk.export.load(tmp_path / "m.jax")(X[:4])
    second = trainer()
    second.fit(X, Y, batch_size=16, epochs=3, verbose=0)
    real_replace = os.replace

    def failing(source, target):
        if os.fspath(target) == str(tmp_path / "m.jax") and ".writing-" in os.fspath(source):
            raise OSError(28, "No space left on device")
        return real_replace(source, target)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="No space left"):
        second.export(tmp_path / "m.jax", verbose=False)
    monkeypatch.setattr(os, "replace", real_replace)
    np.testing.assert_array_equal(tk.export.load(tmp_path / "m.jax")(X[:4]), expected)  # the old pair, checked
    assert sorted(os.listdir(tmp_path)) == ["m.jax", "m.jax.json"]  # nothing stray
