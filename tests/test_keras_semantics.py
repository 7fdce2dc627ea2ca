"""Keras 3's callback semantics, ported from ``keras/src/callbacks/*_test.py`` and run side by side.

Each scenario runs the same tiny problem (a linear regression, the Keras model's initial weights
copied into trainkit, SGD, no shuffling) in Keras 3 (JAX backend) and in trainkit, and compares
what a user observes: the hooks called and their order, epochs run, which epoch's weights were
restored, the files written, CSV rows, learning rates, final weights. A callback's body is
written once (a mixin) and given each framework's ``Callback`` base, as a ported callback would.
"""

import csv
import os

import flax.linen as nn
import numpy as np
import optax
import pytest

import trainkit as tk

keras = pytest.importorskip("keras")
assert keras.backend.backend() == "jax"

N, BATCH = 40, 16  # 3 batches per epoch, the last one ragged (8 rows)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], "float32") + 0.1).astype("float32")
    return x, y


def keras_model(lr=0.05, **optimizer):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(lr, **optimizer), loss="mse")
    return model


def trainkit_twin(model, optimizer=None, lr=0.05):
    kernel, bias = model.get_weights()
    return tk.Trainer(
        nn.Dense(1),
        loss="mse",
        optimizer=optimizer or optax.sgd(lr),
        strategy="single",
        params={"kernel": kernel, "bias": bias},
    )


def flat(weights):
    """Keras's ``[kernel, bias]`` or trainkit's ``{"params": {...}}`` as one list of arrays."""
    if isinstance(weights, dict):
        return [np.asarray(weights["params"]["kernel"]), np.asarray(weights["params"]["bias"])]
    return [np.asarray(w) for w in weights]


def twins(mixin, *args, **kwargs):
    """The same callback body on Keras's and trainkit's ``Callback`` base."""
    keras_cls = type(f"Keras{mixin.__name__}", (mixin, keras.callbacks.Callback), {})
    tk_cls = type(f"Tk{mixin.__name__}", (mixin, tk.callbacks.Callback), {})
    return keras_cls(*args, **kwargs), tk_cls(*args, **kwargs)


def run_both(data, make_callbacks, lr=0.05, epochs=3, tk_optimizer=None, keras_optimizer=None, **fit):
    """Fits the twin models; ``make_callbacks(side)`` gives each side's list ("keras" / "tk")."""
    x, y = data
    model = keras_model(lr, **(keras_optimizer or {}))
    trainer = trainkit_twin(model, tk_optimizer, lr)
    fit = {"epochs": epochs, "batch_size": BATCH, "shuffle": False, "verbose": 0, **fit}
    keras_history = model.fit(x, y, callbacks=make_callbacks("keras"), **fit)
    tk_history = trainer.fit((x, y), callbacks=make_callbacks("tk"), **fit)
    return (model, keras_history), (trainer, tk_history)


# ---------------------------------------------------------------------- hooks
class Recorder:
    """Records every hook with its index and the logs' keys (callback_test.py)."""

    def __init__(self, stop_at_batch=None, stop_at_epoch=None):
        super().__init__()
        self.events, self.stop_at_batch, self.stop_at_epoch = [], stop_at_batch, stop_at_epoch

    def _log(self, name, index=None, logs=None):
        self.events.append((name, index, tuple(sorted(logs or {}))))

    def on_train_begin(self, logs=None):
        self._log("train_begin", logs=logs)

    def on_train_end(self, logs=None):
        self._log("train_end", logs=logs)

    def on_epoch_begin(self, epoch, logs=None):
        self._log("epoch_begin", epoch)

    def on_epoch_end(self, epoch, logs=None):
        self._log("epoch_end", epoch, logs)
        if epoch == self.stop_at_epoch:
            self.model.stop_training = True

    def on_train_batch_begin(self, batch, logs=None):
        self._log("train_batch_begin", batch)

    def on_train_batch_end(self, batch, logs=None):
        self._log("train_batch_end", batch, logs)
        if batch == self.stop_at_batch:
            self.model.stop_training = True

    def on_test_begin(self, logs=None):
        self._log("test_begin")

    def on_test_end(self, logs=None):
        self._log("test_end", logs=logs)

    def on_test_batch_begin(self, batch, logs=None):
        self._log("test_batch_begin", batch)

    def on_test_batch_end(self, batch, logs=None):
        self._log("test_batch_end", batch, logs)

    def on_predict_begin(self, logs=None):
        self._log("predict_begin")

    def on_predict_end(self, logs=None):
        self._log("predict_end")

    def on_predict_batch_begin(self, batch, logs=None):
        self._log("predict_batch_begin", batch)

    def on_predict_batch_end(self, batch, logs=None):
        self._log("predict_batch_end", batch, logs)


def test_every_hook_is_called_in_keras_order_with_keras_arguments(data):
    x, y = data
    recorders = dict(zip(("keras", "tk"), twins(Recorder)))
    (model, _), (trainer, _) = run_both(data, lambda side: [recorders[side]], epochs=2, validation_data=(x, y))
    model.evaluate(x, y, batch_size=BATCH, callbacks=[recorders["keras"]], verbose=0)
    trainer.evaluate((x, y), batch_size=BATCH, callbacks=[recorders["tk"]])
    keras_pred = model.predict(x, batch_size=BATCH, callbacks=[recorders["keras"]], verbose=0)
    tk_pred = trainer.predict(x, batch_size=BATCH, callbacks=[recorders["tk"]])
    assert recorders["tk"].events == recorders["keras"].events
    assert len(recorders["tk"].events) == 1 + 2 * (2 + 2 * 3 + 2 + 2 * 3) + 1 + (2 + 2 * 3) + (2 + 2 * 3)
    np.testing.assert_allclose(tk_pred, keras_pred, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("where", ["batch", "epoch"])
def test_stop_training_from_a_batch_or_an_epoch_hook(data, where):
    stop = {"stop_at_batch": 1} if where == "batch" else {"stop_at_epoch": 1}
    recorders = dict(zip(("keras", "tk"), twins(Recorder, **stop)))
    (model, keras_history), (trainer, tk_history) = run_both(data, lambda side: [recorders[side]], epochs=4)
    assert recorders["tk"].events == recorders["keras"].events
    assert tk_history.epoch == keras_history.epoch == ([0] if where == "batch" else [0, 1])
    assert trainer.global_step == int(model.optimizer.iterations) == (2 if where == "batch" else 6)
    for a, b in zip(flat(trainer.get_weights()), flat(model.get_weights())):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class ReadsWeights:
    """Reads the weights at every batch end: the state after that batch (not async_safe)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(flat(self.model.get_weights()))


def test_a_batch_hook_sees_the_state_after_its_batch(data):
    readers = dict(zip(("keras", "tk"), twins(ReadsWeights)))
    run_both(data, lambda side: [readers[side]], epochs=2)
    assert len(readers["tk"].seen) == len(readers["keras"].seen) == 6
    for ours, theirs in zip(readers["tk"].seen, readers["keras"].seen):
        for a, b in zip(ours, theirs):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_async_safe_callbacks_let_the_loop_run_ahead(data):
    x, y = data

    class Ahead(tk.callbacks.Callback):
        async_safe = True

        def __init__(self):
            self.lag = []

        def on_train_batch_end(self, batch, logs=None):
            self.lag.append(self.trainer.global_step - self.session.record.step)

    ahead = Ahead()
    trainkit_twin(keras_model()).fit((x, y), epochs=2, batch_size=8, shuffle=False, verbose=0, callbacks=[ahead])
    assert max(ahead.lag) == tk.Trainer.__init__.__globals__["Loop"].max_in_flight  # two steps in flight
    assert ahead.lag[-1] == 0  # the epoch's last batches are drained


# ---------------------------------------------------------------------- EarlyStopping
class Inject:
    """Writes a controlled ``val_metric`` into the epoch logs and snapshots the weights."""

    def __init__(self, values):
        super().__init__()
        self.values, self.snapshots = list(values), []

    def on_epoch_end(self, epoch, logs=None):
        logs["val_metric"] = self.values[epoch]
        self.snapshots.append(flat(self.model.get_weights()))


def restored_epoch(final, snapshots):
    """The epoch whose snapshot equals the final weights (None if none)."""
    for epoch, snapshot in enumerate(snapshots):
        if all(np.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(final, snapshot)):
            return epoch
    return None


EARLY_STOPPING = {  # (values per epoch, EarlyStopping arguments)
    "patience": ([1.0, 0.5, 0.7, 0.6, 0.9, 0.1, 0.2], {"patience": 2}),
    "min_delta": ([1.0, 0.95, 0.9, 0.85, 0.5, 0.45], {"patience": 2, "min_delta": 0.1}),
    "baseline": ([1.0, 0.9, 0.8, 0.7, 0.6, 0.5], {"patience": 3, "baseline": 0.55}),
    "restore_when_epochs_run_out": ([1.0, 0.2, 0.5, 0.4], {"patience": 5}),
    "start_from_epoch": ([1.0, 2.0, 3.0, 0.5, 0.9, 0.8], {"patience": 1, "start_from_epoch": 2}),
    "max_mode": ([0.1, 0.5, 0.4, 0.45, 0.3, 0.2], {"patience": 2, "mode": "max"}),
}


@pytest.mark.parametrize("case", sorted(EARLY_STOPPING))
def test_early_stopping_matches_keras(data, case):
    values, arguments = EARLY_STOPPING[case]
    arguments = {"monitor": "val_metric", "mode": "min", "restore_best_weights": True, **arguments}
    injectors = dict(zip(("keras", "tk"), twins(Inject, values)))
    stoppers = {"keras": keras.callbacks.EarlyStopping(**arguments), "tk": tk.callbacks.EarlyStopping(**arguments)}
    (model, keras_history), (trainer, tk_history) = run_both(
        data, lambda side: [injectors[side], stoppers[side]], epochs=len(values)
    )
    assert tk_history.epoch == keras_history.epoch
    for name in ("stopped_epoch", "best_epoch", "wait", "best"):
        assert getattr(stoppers["tk"], name) == getattr(stoppers["keras"], name), name
    ours = restored_epoch(flat(trainer.get_weights()), injectors["tk"].snapshots)
    theirs = restored_epoch(flat(model.get_weights()), injectors["keras"].snapshots)
    assert ours == theirs is not None


class StopAt:
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            self.model.stop_training = True


def test_early_stopping_restores_when_another_callback_stops(data):
    values = [1.0, 0.3, 0.5, 0.6, 0.7]
    injectors = dict(zip(("keras", "tk"), twins(Inject, values)))
    stoppers = dict(zip(("keras", "tk"), twins(StopAt, 3)))
    arguments = {"monitor": "val_metric", "mode": "min", "patience": 10, "restore_best_weights": True}
    early = {"keras": keras.callbacks.EarlyStopping(**arguments), "tk": tk.callbacks.EarlyStopping(**arguments)}
    (model, keras_history), (trainer, tk_history) = run_both(
        data, lambda side: [injectors[side], stoppers[side], early[side]], epochs=5
    )
    assert tk_history.epoch == keras_history.epoch == [0, 1, 2, 3]
    assert restored_epoch(flat(trainer.get_weights()), injectors["tk"].snapshots) == 1
    assert restored_epoch(flat(model.get_weights()), injectors["keras"].snapshots) == 1


def test_unknown_mode_is_an_error_where_keras_warns():
    with pytest.warns(UserWarning, match="mode 'smallest' is unknown"):
        keras.callbacks.EarlyStopping(mode="smallest")
    with pytest.raises(ValueError, match="mode must be 'auto', 'min' or 'max'; received 'smallest'"):
        tk.callbacks.EarlyStopping(mode="smallest")


# ---------------------------------------------------------------------- ModelCheckpoint
CHECKPOINTS = {  # (file name, ModelCheckpoint arguments)
    "every_epoch_template": ("ckpt-{epoch:02d}-{val_metric:.2f}.keras", {}),
    "best_only_template": ("ckpt-{epoch:02d}-{val_metric:.2f}.keras", {"save_best_only": True}),
    "threshold": ("ckpt-{epoch:02d}.keras", {"save_best_only": True, "initial_value_threshold": 0.55}),
    "batches": ("ckpt-{epoch:02d}-{batch:02d}.keras", {"save_freq": 2}),
    "max_mode": ("ckpt-{epoch:02d}.keras", {"save_best_only": True, "mode": "max"}),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINTS))
def test_model_checkpoint_writes_the_files_keras_writes(data, tmp_path, case):
    name, arguments = CHECKPOINTS[case]
    arguments = {"monitor": "val_metric", "mode": "min", **arguments}
    values = [0.9, 0.5, 0.7, 0.4]
    injectors = dict(zip(("keras", "tk"), twins(Inject, values)))
    dirs = {side: tmp_path / side for side in ("keras", "tk")}
    callbacks = {
        "keras": keras.callbacks.ModelCheckpoint(str(dirs["keras"] / name), **arguments),
        "tk": tk.callbacks.ModelCheckpoint(dirs["tk"] / name, **arguments),
    }
    run_both(data, lambda side: [injectors[side], callbacks[side]], epochs=4)
    keras_files = sorted(os.listdir(dirs["keras"])) if dirs["keras"].exists() else []
    assert sorted(os.listdir(dirs["tk"])) == keras_files and keras_files


@pytest.mark.parametrize("save_best_only", [False, True])
def test_a_fixed_path_holds_the_model_keras_would_hold(data, tmp_path, save_best_only):
    x, _ = data
    values = [0.9, 0.5, 0.7, 0.6]
    injectors = dict(zip(("keras", "tk"), twins(Inject, values)))
    arguments = {"monitor": "val_metric", "mode": "min", "save_best_only": save_best_only}
    callbacks = {
        "keras": keras.callbacks.ModelCheckpoint(str(tmp_path / "model.keras"), **arguments),
        "tk": tk.callbacks.ModelCheckpoint(tmp_path / "tk" / "model.keras", **arguments),
    }
    run_both(data, lambda side: [injectors[side], callbacks[side]], epochs=4)
    saved_keras = flat(keras.models.load_model(tmp_path / "model.keras").get_weights())
    reader = trainkit_twin(keras_model())
    reader.init(x)
    manifest = reader.load(tmp_path / "tk" / "model.keras")
    epoch = restored_epoch(flat(reader.get_weights()), injectors["tk"].snapshots)
    assert epoch == restored_epoch(saved_keras, injectors["keras"].snapshots) == (1 if save_best_only else 3)
    assert manifest["position"]["epoch"] == epoch + 1
    assert os.listdir(tmp_path / "tk") == ["model.keras"]


def test_save_best_only_without_the_monitor_warns_and_saves(data, tmp_path):
    callbacks = {
        "keras": keras.callbacks.ModelCheckpoint(
            str(tmp_path / "k-{epoch}.keras"), monitor="missing", mode="min", save_best_only=True
        ),
        "tk": tk.callbacks.ModelCheckpoint(
            tmp_path / "t-{epoch}.keras", monitor="missing", mode="min", save_best_only=True
        ),
    }
    with pytest.warns(UserWarning, match="Can save best model only with missing available"):
        run_both(data, lambda side: [callbacks[side]], epochs=2)
    assert sorted(os.listdir(tmp_path)) == ["k-1.keras", "k-2.keras", "t-1.keras", "t-2.keras"]


def test_save_weights_only_writes_the_variables_that_load_reads(data, tmp_path):
    x, y = data
    model = keras_model()
    trainer = trainkit_twin(model)
    callback = tk.callbacks.ModelCheckpoint(tmp_path / "w.weights.h5", save_weights_only=True, monitor="loss")
    trainer.fit((x, y), epochs=2, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[callback])
    trained = flat(trainer.get_weights())
    fresh = trainkit_twin(model)
    fresh.init(x)
    manifest = fresh.load(tmp_path / "w.weights.h5")
    assert manifest["contents"] == "weights" and set(manifest["tree"]) == {"params", "model_state"}
    for a, b in zip(flat(fresh.get_weights()), trained):
        np.testing.assert_array_equal(a, b)
    assert fresh.global_step == 0  # the optimizer state and step stay the fresh trainer's


# ---------------------------------------------------------------------- CSVLogger
@pytest.mark.parametrize("separator", [",", ";"])
@pytest.mark.parametrize("validation", [False, True])
def test_csv_logger_writes_keras_columns_rows_and_na(data, tmp_path, separator, validation):
    x, y = data
    paths = {side: tmp_path / f"{side}.csv" for side in ("keras", "tk")}
    extra = {"validation_data": (x, y)} if validation else {}
    for append in (False, True):  # the second run appends rows without a second header
        callbacks = {
            "keras": keras.callbacks.CSVLogger(str(paths["keras"]), separator=separator, append=append),
            "tk": tk.callbacks.CSVLogger(paths["tk"], separator=separator, append=append),
        }
        run_both(data, lambda side, c=callbacks: [c[side]], epochs=2, **extra)
    read = {side: list(csv.reader(open(paths[side]), delimiter=separator)) for side in paths}
    assert read["tk"][0] == read["keras"][0] == ["epoch", "loss", "val_loss"]
    assert len(read["tk"]) == len(read["keras"]) == 5
    for ours, theirs in zip(read["tk"][1:], read["keras"][1:]):
        assert ours[0] == theirs[0]
        for a, b in zip(ours[1:], theirs[1:]):
            assert (a == b == "NA") or float(a) == pytest.approx(float(b), rel=1e-5)


# ---------------------------------------------------------------------- TerminateOnNaN
@pytest.mark.parametrize("raise_error", [False, True])
def test_terminate_on_nan_lets_no_update_through_after_the_nan_batch(data, raise_error):
    x, y = data
    x = x.copy()
    x[20] = np.inf  # batch 1
    model = keras_model()
    trainer = trainkit_twin(model)
    fit = {"epochs": 3, "batch_size": BATCH, "shuffle": False, "verbose": 0}
    if raise_error:
        with pytest.raises(RuntimeError, match="NaN or Inf loss encountered at batch 1"):
            model.fit(x, y, callbacks=[keras.callbacks.TerminateOnNaN(raise_error=True)], **fit)
        with pytest.raises(RuntimeError, match="NaN or Inf loss encountered at batch 1"):
            trainer.fit((x, y), callbacks=[tk.callbacks.TerminateOnNaN(raise_error=True)], **fit)
    else:
        keras_history = model.fit(x, y, callbacks=[keras.callbacks.TerminateOnNaN()], **fit)
        with pytest.warns(UserWarning, match="the loss became nan at batch 1 of epoch 0"):
            tk_history = trainer.fit((x, y), callbacks=[tk.callbacks.TerminateOnNaN()], **fit)
        assert tk_history.epoch == keras_history.epoch == [0]
    assert trainer.global_step == int(model.optimizer.iterations) == 2
    assert np.isnan(flat(trainer.get_weights())[0]).all() and np.isnan(flat(model.get_weights())[0]).all()


# ---------------------------------------------------------------------- LambdaCallback
def test_lambda_callback_takes_keras_lambdas_for_every_hook(data):
    x, y = data
    events = {"keras": [], "tk": []}

    def make(side):
        seen = events[side]
        return {
            "on_train_begin": lambda logs: seen.append("train_begin"),
            "on_train_end": lambda logs: seen.append(("train_end", sorted(logs))),
            "on_epoch_begin": lambda epoch, logs: seen.append(("epoch_begin", epoch)),
            "on_epoch_end": lambda epoch, logs: seen.append(("epoch_end", epoch, sorted(logs))),
            "on_train_batch_begin": lambda batch, logs: seen.append(("batch_begin", batch)),
            "on_train_batch_end": lambda batch, logs: seen.append(("batch_end", batch)),
            "on_test_begin": lambda logs: seen.append("test_begin"),
            "on_test_end": lambda logs: seen.append("test_end"),
            "on_predict_end": lambda logs: seen.append("predict_end"),
            "owner": side,
        }

    callbacks = {
        "keras": keras.callbacks.LambdaCallback(**make("keras")),
        "tk": tk.callbacks.LambdaCallback(**make("tk")),
    }
    (model, _), (trainer, _) = run_both(data, lambda side: [callbacks[side]], epochs=2, validation_data=(x, y))
    model.predict(x, callbacks=[callbacks["keras"]], verbose=0)
    trainer.predict(x, callbacks=[callbacks["tk"]])
    assert events["tk"] == events["keras"] and len(events["tk"]) == 1 + 2 * (2 + 6 + 2) + 1 + 1
    assert callbacks["tk"].owner == "tk"


# ---------------------------------------------------------------------- BackupAndRestore
class Interrupt:
    def __init__(self, at_epoch, at_batch):
        super().__init__()
        self.at = (at_epoch, at_batch)
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_where_keras_resumes(data, tmp_path):
    x, y = data
    model = keras_model()
    trainer = trainkit_twin(model)
    fit = {"epochs": 3, "batch_size": BATCH, "shuffle": False, "verbose": 0}
    interrupts = dict(zip(("keras", "tk"), twins(Interrupt, 1, 1)))
    backups = {
        "keras": keras.callbacks.BackupAndRestore(str(tmp_path / "k")),
        "tk": tk.callbacks.BackupAndRestore(tmp_path / "t"),
    }
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(x, y, callbacks=[backups["keras"], interrupts["keras"]], **fit)
    with pytest.raises(RuntimeError, match="interrupted"):
        trainer.fit((x, y), callbacks=[backups["tk"], interrupts["tk"]], **fit)
    assert (tmp_path / "t").exists()  # kept when fit raises
    # a new process: fresh models; the backup holds the end of epoch 0, so both resume at epoch 1
    model, trainer = keras_model(), trainkit_twin(keras_model())
    keras_history = model.fit(x, y, callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "k"))], **fit)
    tk_history = trainer.fit((x, y), callbacks=[tk.callbacks.BackupAndRestore(tmp_path / "t")], **fit)
    assert tk_history.epoch == keras_history.epoch == [1, 2]
    for a, b in zip(flat(trainer.get_weights()), flat(model.get_weights())):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not (tmp_path / "t").exists() and not (tmp_path / "k").exists()  # deleted on completion


def overwrite_every_file(paths):
    for path in paths:
        path.write_bytes(b"3")


@pytest.mark.parametrize("double_checkpoint", [True, False])
def test_a_corrupt_newest_backup_falls_back_to_the_previous_one_as_in_keras(data, tmp_path, double_checkpoint):
    """double_checkpoint=True: every file of the newest backup overwritten, both resume from
    the one before (the end of epoch 0); without a previous backup, both refuse to resume."""
    x, y = data
    model = keras_model()
    trainer = trainkit_twin(model)
    fit = {"epochs": 4, "batch_size": BATCH, "shuffle": False, "verbose": 0}
    interrupts = dict(zip(("keras", "tk"), twins(Interrupt, 2, 1)))
    backup = {"double_checkpoint": double_checkpoint}
    keras_backup = keras.callbacks.BackupAndRestore(str(tmp_path / "k"), **backup)
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(x, y, callbacks=[keras_backup, interrupts["keras"]], **fit)
    tk_backup = tk.callbacks.BackupAndRestore(tmp_path / "t", **backup)
    with pytest.raises(RuntimeError, match="interrupted"):
        trainer.fit((x, y), callbacks=[tk_backup, interrupts["tk"]], **fit)
    overwrite_every_file([p for p in (tmp_path / "k").iterdir() if not p.name.endswith(".bkp")])
    newest = max((p for p in (tmp_path / "t").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    overwrite_every_file([p for p in newest.rglob("*") if p.is_file()])
    model, trainer = keras_model(), trainkit_twin(keras_model())
    keras_backup = keras.callbacks.BackupAndRestore(str(tmp_path / "k"), **backup)
    tk_backup = tk.callbacks.BackupAndRestore(tmp_path / "t", **backup)
    if not double_checkpoint:
        with pytest.raises(Exception):  # noqa: B017 - h5py's OSError
            model.fit(x, y, callbacks=[keras_backup], **fit)
        with pytest.raises(tk.CheckpointError, match=r"every backup .* is corrupt .*Delete the directory"):
            with pytest.warns(UserWarning, match="moved to"):
                trainer.fit((x, y), callbacks=[tk_backup], **fit)
        return
    keras_history = model.fit(x, y, callbacks=[keras_backup], **fit)
    with pytest.warns(UserWarning, match=f"step {newest.name} .* is corrupt .*moved to {newest.name}.unreadable"):
        tk_history = trainer.fit((x, y), callbacks=[tk_backup], **fit)
    assert tk_history.epoch == keras_history.epoch == [1, 2, 3]
    for a, b in zip(flat(trainer.get_weights()), flat(model.get_weights())):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backup_dir", ["", None])
def test_backup_and_restore_needs_a_directory(backup_dir):
    with pytest.raises(ValueError, match="Empty `backup_dir` argument passed"):
        keras.callbacks.BackupAndRestore(backup_dir)
    with pytest.raises(ValueError, match="Empty `backup_dir` argument passed"):
        tk.callbacks.BackupAndRestore(backup_dir)
    for save_freq in ("batch", 0):
        with pytest.raises(ValueError, match="save_freq"):
            tk.callbacks.BackupAndRestore("/tmp/x", save_freq=save_freq)


# ---------------------------------------------------------------------- learning rate
def test_reduce_lr_on_plateau_matches_keras(data):
    values = [1.0, 0.9, 0.95, 0.97, 0.99, 0.5, 0.6, 0.7]
    injectors = dict(zip(("keras", "tk"), twins(Inject, values)))
    arguments = {"monitor": "val_metric", "mode": "min", "factor": 0.5, "patience": 1, "cooldown": 1, "min_lr": 0.01}
    callbacks = {
        "keras": keras.callbacks.ReduceLROnPlateau(**arguments),
        "tk": tk.callbacks.ReduceLROnPlateau(**arguments),
    }
    (model, keras_history), (trainer, tk_history) = run_both(
        data,
        lambda side: [injectors[side], callbacks[side]],
        epochs=len(values),
        lr=0.08,
        tk_optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=0.08),
    )
    np.testing.assert_allclose(tk_history.history["learning_rate"], keras_history.history["learning_rate"], rtol=1e-6)
    assert trainer.learning_rate == pytest.approx(float(model.optimizer.learning_rate), rel=1e-6)
    for a, b in zip(flat(trainer.get_weights()), flat(model.get_weights())):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_learning_rate_scheduler_matches_keras(data):
    def schedule(epoch, lr):
        return lr if epoch < 1 else float(lr * 0.5)

    callbacks = {
        "keras": keras.callbacks.LearningRateScheduler(schedule),
        "tk": tk.callbacks.LearningRateScheduler(schedule),
    }
    (model, keras_history), (trainer, tk_history) = run_both(
        data, lambda side: [callbacks[side]], epochs=3, tk_optimizer=optax.inject_hyperparams(optax.sgd)(0.05)
    )
    np.testing.assert_allclose(tk_history.history["learning_rate"], keras_history.history["learning_rate"])
    for a, b in zip(flat(trainer.get_weights()), flat(model.get_weights())):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_learning_rate_callbacks_need_an_exposed_learning_rate(data):
    x, y = data
    trainer = trainkit_twin(keras_model())
    with pytest.raises(ValueError, match="optax.inject_hyperparams"):
        trainer.fit((x, y), verbose=0, callbacks=[tk.callbacks.ReduceLROnPlateau(monitor="loss")])
    assert trainer.global_step == 0  # refused before the first step


# ---------------------------------------------------------------------- SwapEMAWeights
def test_swap_ema_weights_validates_with_the_average_as_keras(data):
    x, y = data
    callbacks = {"keras": keras.callbacks.SwapEMAWeights(), "tk": tk.callbacks.SwapEMAWeights()}
    (model, keras_history), (trainer, tk_history) = run_both(
        data,
        lambda side: [callbacks[side]],
        epochs=3,
        validation_data=(x, y),
        keras_optimizer={"use_ema": True, "ema_momentum": 0.9},
        tk_optimizer=tk.optimizers.with_ema(optax.sgd(0.05), momentum=0.9),
    )
    np.testing.assert_allclose(tk_history.history["val_loss"], keras_history.history["val_loss"], rtol=1e-5)
    np.testing.assert_allclose(tk_history.history["loss"], keras_history.history["loss"], rtol=1e-5)
    assert tk_history.history["val_loss"] != pytest.approx(
        trainer.evaluate((x, y), batch_size=BATCH), rel=1e-3
    )  # without the callback, evaluate uses the raw weights


def test_progbar_logger_is_the_progress_bar():
    assert tk.callbacks.ProgbarLogger is tk.callbacks.ProgressBar
    assert tk.callbacks.ProgbarLogger().verbose is None  # taken from fit's verbose, as Keras
