"""Checkpoints that never lose or poison the state: overwrite or refuse, read-only loading,
one writer per directory, no non-finite parameters saved, corrupt checkpoints skipped with a
reason, one save in flight."""

import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from conftest import saved_steps

import trainkit as tk
from trainkit.callbacks import BackupAndRestore, Callback, ModelCheckpoint
from trainkit.checkpoint import Checkpointer, CheckpointError


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32")


def make():
    return tk.Trainer(nn.Dense(2), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single")


def kernel(trainer):
    return np.asarray(trainer.get_weights()["params"]["kernel"])


def test_saving_a_step_again_replaces_it_or_refuses(data, tmp_path):
    x, y = data
    trainer = make()
    trainer.fit(x, y, batch_size=16, verbose=0)
    trainer.save(tmp_path / "ck")
    trainer.set_weights(jax.tree.map(lambda a: a + 1.0, trainer.get_weights()))  # same step, new weights
    assert trainer.save(tmp_path / "ck") == 2
    restored = make()
    restored.init(x)
    restored.load(tmp_path / "ck")
    np.testing.assert_array_equal(kernel(restored), kernel(trainer))  # the new weights, not the old
    with pytest.raises(CheckpointError, match="already holds step 2; pass overwrite=True"):
        trainer.save(tmp_path / "ck", overwrite=False)


def test_load_works_on_a_read_only_file_system(data, tmpfs):
    x, y = data
    trainer = make()
    trainer.fit(x, y, batch_size=16, verbose=0)
    trainer.save(tmpfs / "ck")
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    with pytest.raises(OSError):
        (tmpfs / "probe").write_text("x")  # really read-only, even for root
    restored = make()
    restored.init(x)
    assert restored.load(tmpfs / "ck")["position"]["global_step"] == 2
    np.testing.assert_array_equal(kernel(restored), kernel(trainer))
    with pytest.raises(CheckpointError, match="Cannot write checkpoints"):
        trainer.save(tmpfs / "other")


def test_two_writers_in_one_directory_are_refused(data, tmp_path):
    x, y = data
    first = Checkpointer(tmp_path / "shared")
    with pytest.raises(CheckpointError, match=rf"is being written by pid {os.getpid()}.*its own directory"):
        Checkpointer(tmp_path / "shared")
    other_process = textwrap.dedent(
        f"""
        from trainkit.checkpoint import Checkpointer, CheckpointError
        try:
            Checkpointer({str(tmp_path / "shared")!r})
        except CheckpointError as error:
            print("refused:", error)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run([sys.executable, "-c", other_process], capture_output=True, text=True, env=env)
    assert f"refused: '{tmp_path / 'shared'}' is being written by pid {os.getpid()}" in result.stdout, result.stderr
    trainer = make()
    with pytest.raises(CheckpointError, match="is being written by"):
        trainer.fit(x, y, batch_size=16, verbose=0, callbacks=[ModelCheckpoint(tmp_path / "shared")])
    first.close()
    trainer.fit(x, y, batch_size=16, verbose=0, callbacks=[ModelCheckpoint(tmp_path / "shared")])  # free now
    assert saved_steps(tmp_path / "shared") == [2]


class PoisonAtEpoch(Callback):
    """Makes the parameters NaN at the end of one epoch, before the checkpoint callbacks run:
    the logged loss is finite, the state is not (a save must judge the state it writes)."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            self.trainer.set_weights(jax.tree.map(lambda a: a * np.nan, self.trainer.get_weights()))


@pytest.mark.parametrize("kind", ["best_only", "backup"])
def test_non_finite_parameters_are_never_saved_and_the_last_good_checkpoint_stays(data, tmp_path, kind):
    x, y = data
    if kind == "best_only":
        saver = ModelCheckpoint(tmp_path / "ck", monitor="loss", save_best_only=True, mode="min", max_to_keep=1)
    else:
        saver = BackupAndRestore(tmp_path / "ck", delete_checkpoint=False)
    trainer = make()
    with pytest.warns(UserWarning, match="Not saving step 4 .*parameters are not all finite"):
        trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[PoisonAtEpoch(1), saver])
    assert saved_steps(tmp_path / "ck") == [2]  # the finite one, not deleted
    with pytest.raises(CheckpointError, match="not all finite"):
        trainer.save(tmp_path / "direct")
    assert trainer.save(tmp_path / "direct", allow_non_finite=True) == 4  # when asked


def corrupt(path: pathlib.Path, how: str) -> None:
    if how == "truncate":
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    else:  # every data file of the arrays, truncated
        for file in path.rglob("*"):
            if file.is_file():
                file.write_bytes(file.read_bytes()[:8])


@pytest.mark.parametrize(
    "target, how, reason",
    [
        ("state/_METADATA", "truncate", "_METADATA' is unreadable"),
        ("meta/metadata", "truncate", "metadata' is unreadable"),
        ("state/d", "data", "arrays of step 4 .* are corrupt or incomplete"),
    ],
)
def test_a_corrupt_latest_checkpoint_is_skipped_naming_it(data, tmp_path, target, how, reason):
    x, y = data
    trainer = make()
    checkpoint = ModelCheckpoint(tmp_path / "ck", monitor="loss", max_to_keep=2)
    trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[checkpoint])
    corrupt(tmp_path / "ck" / "4" / target, how)
    restored = make()
    restored.init(x)
    with pytest.warns(UserWarning, match=rf"Skipping checkpoint step 4.*{reason}"):
        assert restored.load(tmp_path / "ck")["position"]["global_step"] == 2
    with pytest.raises(CheckpointError, match="step 4"):
        restored.load(tmp_path / "ck", step=4)  # asked for by step: an error naming it, not a fallback


def test_frequent_saves_keep_at_most_one_write_in_flight(data, tmp_path):
    x, y = data
    checkpointer = Checkpointer(tmp_path / "ck", max_to_keep=2)
    trainer = make()
    trainer.init(x)
    in_flight = []
    for step in range(1, 6):
        checkpointer.save(step, trainer.state, trainer.manifest())
        in_flight.append(sum(not f.done() for f in checkpointer._pending))
    checkpointer.close()
    assert max(in_flight) <= 1
    assert saved_steps(tmp_path / "ck") == [4, 5]


def test_a_write_still_in_flight_when_the_process_exits_is_completed(tmp_path):
    script = textwrap.dedent(
        f"""
        import numpy as np, optax, flax.linen as nn, trainkit as tk
        from trainkit.checkpoint import Checkpointer
        trainer = tk.Trainer(nn.Dense(256), loss="mse", optimizer=optax.adam(0.1), strategy="single")
        trainer.init(np.ones((1, 512), "float32"))
        Checkpointer({str(tmp_path / "ck")!r}).save(7, trainer.state, trainer.manifest())  # returns at once
        """
    )  # ... and the interpreter exits without waiting
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    if sys.version_info >= (3, 12):  # no thread may start at exit: the write is durably abandoned, and said so
        assert "still in flight at exit was abandoned" in result.stderr, result.stderr
        assert saved_steps(tmp_path / "ck") in ([], [7])
    else:
        assert (tmp_path / "ck" / "7" / "commit_success.txt").exists(), result.stderr
        assert saved_steps(tmp_path / "ck") == [7]


def test_backup_and_restore_refuses_a_weights_only_checkpoint(data, tmp_path):
    """Resuming from weights alone restarted the optimizer and its schedule while the loop went
    on at the saved step (global_step 48, state.step 16): refused, naming the way out."""
    x, y = data
    make().fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        verbose=0,
        callbacks=[ModelCheckpoint(tmp_path / "ck", monitor="loss", save_weights_only=True)],
    )
    trainer = make()
    with pytest.raises(CheckpointError, match=r"holds a save_weights_only checkpoint .*directory of its own"):
        trainer.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[BackupAndRestore(tmp_path / "ck")])
    assert trainer.global_step == 0


def edit_manifest(step_dir: pathlib.Path, edit) -> None:
    path = step_dir / "meta" / "metadata"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda m: m["position"].update(global_step="abc"), r"position.global_step = 'abc'"),
        (lambda m: m["position"].update(epoch=-1), r"position.epoch = -1"),
        (lambda m: m.pop("position"), r"has no position"),
        (lambda m: m["position"].update(global_step=3), r"hold the state of step 4, but its manifest says step 3"),
    ],
)
def test_a_tampered_manifest_is_a_checkpoint_error_naming_the_field(data, tmp_path, edit, field):
    x, y = data
    interrupted = make()
    with pytest.raises(RuntimeError, match="stop"):
        interrupted.fit(
            x,
            y,
            batch_size=16,
            epochs=3,
            verbose=0,
            callbacks=[BackupAndRestore(tmp_path / "backup"), tk.callbacks.LambdaCallback(on_epoch_end=stop_at(1))],
        )
    edit_manifest(tmp_path / "backup" / "4", edit)
    resumed = make()
    with pytest.raises(CheckpointError, match=field):
        resumed.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[BackupAndRestore(tmp_path / "backup")])
    assert resumed.global_step == 0  # nothing trained on a guessed position


def stop_at(epoch):
    def stop(current, logs=None):
        if current == epoch:
            raise RuntimeError("stop")

    return stop


@pytest.mark.parametrize(
    "other, path",
    [
        ({"optimizer": optax.adamw(1e-2)}, r"opt_state.2: the model has a subtree, the checkpoint nothing"),
        ({"precision": "fp16"}, r"loss_scale: the model has a subtree, the checkpoint an array"),
    ],
)
def test_a_checkpoint_of_another_optimizer_or_precision_says_what_differs(data, tmp_path, other, path):
    """Not "corrupt or incomplete": the checkpoint is valid, the state's structure differs."""
    x, y = data
    settings = {"loss": "sparse_categorical_crossentropy", "optimizer": optax.adam(1e-2), "strategy": "single"}
    trainer = tk.Trainer(nn.Dense(2), **settings)
    trainer.fit(x, y, batch_size=16, epochs=1, verbose=0)
    trainer.save(tmp_path / "ck")
    restored = tk.Trainer(nn.Dense(2), **{**settings, **other})
    restored.init(x)
    with pytest.raises(CheckpointError, match=rf"does not match this model and optimizer.*{path}.*same optimizer"):
        restored.load(tmp_path / "ck")


def test_a_symlinked_backup_dir_is_emptied_when_the_run_completes(data, tmp_path):
    """rmtree refuses a link (and its failure was ignored), so the next, independent fit
    "resumed" the finished run; now what the link points to is emptied."""
    x, y = data
    (tmp_path / "real").mkdir()
    link = tmp_path / "backup"
    link.symlink_to(tmp_path / "real")
    make().fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[BackupAndRestore(link)])
    assert link.is_symlink() and not any(p.name.isdigit() for p in (tmp_path / "real").iterdir())
    fresh = make()
    fresh.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[BackupAndRestore(link)])
    assert fresh.global_step == 4  # all of its own steps: nothing "resumed"


@pytest.mark.parametrize("name", ["sweep[lr=0.01]", "run[1]", "a**b"])
def test_a_path_with_glob_characters_saves_and_loads(data, tmp_path, name):
    """orbax reads [ ] and ** as a glob pattern: such a checkpoint was written in part and
    never found again. It is now read and written through a link without them."""
    x, y = data
    trainer = make()
    trainer.fit(x, y, batch_size=16, epochs=1, verbose=0)
    trainer.save(tmp_path / name / "ck")
    restored = make()
    restored.init(x)
    assert restored.load(tmp_path / name / "ck")["position"]["global_step"] == 2
    tree_equal = jax.tree.map(np.array_equal, restored.params, trainer.params)
    assert all(jax.tree.leaves(tree_equal))
    backup = tmp_path / name / "backup"
    make().fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[BackupAndRestore(backup)])
    assert not backup.exists()  # completed: deleted


@pytest.mark.parametrize(
    "template, message",
    [
        ("ck-{}", r"positional field \{\}"),
        ("ck-{0}", r"positional field \{0\}"),
        ("ck-{epoch", r"is not a valid template"),
        ("ck-}", r"is not a valid template"),
    ],
)
def test_a_checkpoint_template_that_cannot_format_fails_before_the_first_step(data, tmp_path, template, message):
    x, y = data
    trainer = make()
    checkpoint = ModelCheckpoint(str(tmp_path / template), monitor="val_loss")
    with pytest.raises(ValueError, match=message):
        trainer.fit(x, y, batch_size=16, epochs=2, verbose=0, validation_data=(x, y), callbacks=[checkpoint])
    assert trainer.global_step == 0


def test_a_misspelt_template_name_is_warned_about_before_the_first_step(data, tmp_path):
    """Keras formats whatever the logs hold at the save (a callback may add a name), so an
    unknown name stays a KeyError at the first save, as in Keras, and is warned about first."""
    import warnings

    x, y = data
    checkpoint = ModelCheckpoint(str(tmp_path / "ck-{epoch:02d}-{val_acc:.2f}"), monitor="val_loss")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warned_by_step = []
        count = tk.callbacks.LambdaCallback(
            on_train_batch_begin=lambda b, logs=None: warned_by_step.append(len(caught))
        )
        with pytest.raises(KeyError, match="val_acc"):
            make().fit(x, y, batch_size=16, epochs=2, verbose=0, validation_data=(x, y), callbacks=[checkpoint, count])
    texts = [str(w.message) for w in caught]
    assert any(re.search(r"names \{val_acc\}, which fit does not log: the logs hold \[.*'val_loss'", t) for t in texts)
    assert warned_by_step[0] >= 1  # before the first step


def test_a_template_of_logged_names_formats(data, tmp_path):
    x, y = data
    checkpoint = ModelCheckpoint(str(tmp_path / "ck-{epoch:02d}-{val_loss:.2f}-{loss:.2f}"), monitor="val_loss")
    make().fit(x, y, batch_size=16, epochs=2, verbose=0, validation_data=(x, y), callbacks=[checkpoint])
    assert len(list(tmp_path.glob("ck-0*"))) == 2


def test_a_full_disk_during_a_save_is_one_message_and_the_tracebacks_go_to_the_debug_log(tmp_path):
    script = textwrap.dedent(
        """
        import logging, resource, signal, sys, numpy as np, optax, flax.linen as nn
        import trainkit as tk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        if sys.argv[2] == "debug":
            logging.getLogger("trainkit").setLevel(logging.DEBUG)  # trainkit's debug log on
        trainer = tk.Trainer(nn.Dense(512), loss="mse", optimizer=optax.adam(1e-3), strategy="single")
        trainer.init(np.ones((4, 1024), np.float32))
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # the disk fills at 100 kB
        try:
            trainer.save(sys.argv[1])
        except tk.checkpoint.CheckpointError as error:
            print("CheckpointError:", str(error)[:80])
        import os
        print("left:", sorted(os.listdir(sys.argv[1])))
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["TRAINKIT_COMPILATION_CACHE"] = "off"
    runs = {}
    for mode in ("plain",):
        runs[mode] = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / mode), mode], env=env, capture_output=True, text=True
        )
        assert "CheckpointError: Writing a checkpoint to" in runs[mode].stdout, runs[mode].stdout + runs[mode].stderr
        assert "orbax-checkpoint-tmp" not in runs[mode].stdout, runs[mode].stdout  # the half-written step removed
    # one message: tensorstore's late write completions, reported to orbax's closed event loop as
    # the interpreter exits (about 1 run in 3), are debug records (the test after next checks it
    # deterministically), and so is asyncio's "Task exception was never retrieved" (the next test)
    stderr = runs["plain"].stderr
    assert "Traceback" not in stderr, runs["plain"].stderr
    from trainkit.checkpoint.orbax_logs import ThreadTracebacksToDebug

    failure = (OSError, OSError("File too large"), None)
    record = logging.LogRecord("absl", logging.ERROR, f"{os.sep}orbax{os.sep}future.py", 1, "raised", (), failure)
    trainkit_logger, level = logging.getLogger("trainkit"), logging.getLogger("trainkit").level
    trainkit_logger.setLevel(logging.DEBUG)  # trainkit's debug log on: the traceback is kept, as a debug record
    try:
        assert ThreadTracebacksToDebug().filter(record) and record.levelno == logging.DEBUG
    finally:
        trainkit_logger.setLevel(level)


def test_a_completion_reported_to_a_closed_event_loop_is_a_debug_record(caplog):
    """tensorstore's threads report a write that finishes after orbax's event loop closed through
    ``call_soon_threadsafe``, whose ``RuntimeError`` goes to ``sys.unraisablehook``: a finaliser
    that does the same stands in. Any other unraisable exception still reaches the hook before."""
    import asyncio
    import gc

    from trainkit.checkpoint import orbax_logs

    loop = asyncio.new_event_loop()
    loop.close()

    class Late:
        def __del__(self):
            loop.call_soon_threadsafe(print)

    class Other:
        def __del__(self):
            raise ValueError("not a late completion")

    seen: list = []
    before = sys.unraisablehook
    sys.unraisablehook = seen.append
    trainkit_logger, level = logging.getLogger("trainkit"), logging.getLogger("trainkit").level
    try:
        orbax_logs.install()
        trainkit_logger.setLevel(logging.DEBUG)
        with caplog.at_level(logging.DEBUG, logger="trainkit"):
            Late(), Other()
            gc.collect()
    finally:
        sys.unraisablehook = before
        trainkit_logger.setLevel(level)
    assert [type(u.exc_value).__name__ for u in seen] == ["ValueError"], seen
    late = [r for r in caplog.records if "finished after orbax's event loop closed" in r.getMessage()]
    assert [r.levelno for r in late] == [logging.DEBUG] and "Event loop is closed" in caplog.text


def test_a_failed_write_left_in_orbax_s_closed_event_loop_is_a_debug_record(caplog):
    """asyncio logs a failed task nobody awaited ("Task exception was never retrieved") when it is
    collected: orbax's loop stops at the first failed write, so a full disk leaves its sibling
    writes there. A coroutine compiled under an orbax path stands in for orbax's write_fragment."""
    import asyncio
    import gc

    from trainkit.checkpoint import orbax_logs

    orbax_logs.install()  # what every Checkpointer does
    source = "async def write_fragment():\n    raise OSError('File too large')\n"
    namespace: dict = {}
    exec(compile(source, os.path.join(os.sep, "site", "orbax", "serialization.py"), "exec"), namespace)

    def leave_a_failed_task() -> None:
        loop = asyncio.new_event_loop()
        task = loop.create_task(namespace["write_fragment"]())
        loop.run_until_complete(asyncio.sleep(0.01))
        loop.close()
        assert task.done()
        del task
        gc.collect()  # asyncio reports the unretrieved exception as the task is collected

    trainkit_logger, level = logging.getLogger("trainkit"), logging.getLogger("trainkit").level
    with caplog.at_level(logging.DEBUG):  # every record reaches caplog, asyncio's debug ones too
        try:
            trainkit_logger.setLevel(logging.INFO)  # trainkit's debug log off: not shown
            leave_a_failed_task()
            assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
            trainkit_logger.setLevel(logging.DEBUG)  # on: kept, as a debug record
            leave_a_failed_task()
        finally:
            trainkit_logger.setLevel(level)
    reported = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert [(r.name, r.levelno) for r in reported] == [("asyncio", logging.DEBUG)]
    assert "File too large" in caplog.text


def test_a_checkpoint_of_an_older_layout_is_named_as_such(data, tmp_path):
    """#59: a checkpoint whose state paths an older trainkit spelt otherwise was refused as "another
    model and optimizer"; the manifest now records its layout, and the error says which wrote it."""
    x, y = data
    interrupted = make()
    with pytest.raises(RuntimeError, match="stop"):
        stop = tk.callbacks.LambdaCallback(on_epoch_end=stop_at(1))
        interrupted.fit(
            x, y, batch_size=16, epochs=3, verbose=0, callbacks=[BackupAndRestore(tmp_path / "backup"), stop]
        )

    def older(manifest):
        assert manifest.pop("layout") == 2
        manifest["trainkit_version"] = "0.0.9"
        params = manifest["tree"]["params"]  # one path spelt as an older trainkit might have
        for name in list(params)[:1]:
            params["['old_spelling']" + name] = params.pop(name)

    edit_manifest(tmp_path / "backup" / "4", older)
    with pytest.raises(CheckpointError, match=r"written by an older trainkit \(0\.0\.9, checkpoint layout 1; this one"):
        make().fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[BackupAndRestore(tmp_path / "backup")])


def test_a_journal_write_killed_midway_leaves_a_backup_that_resumes_and_is_cleaned_up(data, tmp_path):
    """A process killed while ``goodput.json`` was being replaced leaves the old journal set aside
    (``.goodput.json.old-<pid>``, as test_faults' kill -9 once did): the next run resumes from the backup
    (not refused as a folder holding foreign files), and deletes it with the backups when it completes."""
    x, y = data
    backup = tmp_path / "backup"
    stop = tk.callbacks.LambdaCallback(on_epoch_end=stop_at(1))
    with pytest.raises(RuntimeError, match="stop"):
        make().fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[BackupAndRestore(backup), stop])
    (backup / ".goodput.json.old-6636").write_text("{}")  # the aside copy a killed commit leaves
    resumed, straight = make(), make()
    resumed.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[BackupAndRestore(backup)])
    straight.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert resumed.global_step == straight.global_step > 0 and not backup.exists()
    for ours, theirs in zip(
        jax.tree.leaves(resumed.get_weights()), jax.tree.leaves(straight.get_weights()), strict=True
    ):
        np.testing.assert_array_equal(ours, theirs)
