"""Monitoring read back by each backend's own reader: TensorBoard's event accumulator, MLflow's
client, W&B's offline files, the profiler's trace, and the throughput figures."""

import collections
import glob
import gzip
import json
import os
import re
import time

import flax.linen as nn
import numpy as np
import optax
import pytest
from conftest import MLP, Wide, classifier, make_classification, own_stderr_lines, saved_steps

import trainkit as tk
from trainkit.core import chips
from trainkit.monitoring import throughput

X, Y = make_classification(96)
X_VAL, Y_VAL = make_classification(32, seed=1)


def trainer():
    return classifier(
        optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=1e-2), strategy="auto", metrics=["accuracy"]
    )


def fit(callbacks, epochs=3):
    run = trainer()
    history = run.fit(
        (X, Y), batch_size=16, epochs=epochs, validation_data=(X_VAL, Y_VAL), callbacks=callbacks, verbose=0
    )
    return run, history


def scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return events


def test_tensorboard_scalars_are_read_back_by_tensorboard_under_keras_runs_and_tags(tmp_path):
    pytest.importorskip("tensorboardX")
    pytest.importorskip("tensorboard")
    board = tk.callbacks.TensorBoard(tmp_path, histogram_freq=1, update_freq=2, write_steps_per_second=True)
    _, history = fit([board])
    train, validation = scalars(tmp_path / "train"), scalars(tmp_path / "validation")
    for run, key in ((train, "loss"), (train, "accuracy"), (validation, "loss"), (validation, "accuracy")):
        name = key if run is train else f"val_{key}"
        events = run.Scalars(f"epoch_{key}")
        assert [e.step for e in events] == [0, 1, 2]
        np.testing.assert_allclose([e.value for e in events], history.history[name], rtol=1e-6)
    assert [e.step for e in train.Scalars("batch_loss")] == list(range(2, 19, 2))  # 6 steps per epoch, every 2nd
    assert [round(e.value, 6) for e in train.Scalars("epoch_learning_rate")] == [0.01] * 3
    assert all(e.value > 0 for e in train.Scalars("epoch_examples_per_second"))
    assert len(train.Scalars("epoch_steps_per_second")) == 3
    assert [e.step for e in validation.Scalars("evaluation_loss_vs_iterations")] == [6, 12, 18]
    assert set(train.Tags()["histograms"]) >= {"Dense_0/kernel/histogram", "Dense_1/bias/histogram"}
    assert "epoch_loss" not in validation.Tags()["histograms"]


def test_profile_batch_traces_exactly_the_requested_steps(tmp_path):
    fit([tk.callbacks.TensorBoard(tmp_path, profile_batch=(3, 4))], epochs=1)
    traces = glob.glob(str(tmp_path / "train" / "plugins" / "profile" / "*" / "perfetto_trace.json.gz"))
    assert len(traces) == 1, os.listdir(tmp_path)  # in the train run, as Keras writes it
    assert glob.glob(os.path.join(os.path.dirname(traces[0]), "*.xplane.pb"))  # TensorBoard's profile plugin
    events = json.load(gzip.open(traces[0]))
    events = events["traceEvents"] if isinstance(events, dict) else events
    steps = sorted({int(e["args"]["step_num"]) for e in events if e.get("name") == "train"})
    assert steps == [3, 4]


def test_profiler_memory_profile_and_bad_steps(tmp_path):
    fit([tk.callbacks.Profiler(tmp_path, steps=(2, 2), memory_profile=True)], epochs=1)
    assert (tmp_path / "memory.prof").stat().st_size > 0
    with pytest.raises(ValueError, match=r"steps must be \(first, last\)"):
        tk.callbacks.Profiler(tmp_path, steps=(5, 2))


def test_mlflow_run_is_read_back_by_its_client(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logger = tk.loggers.MLflowLogger(uri, experiment="digits", run_name="first")
    run, history = fit([tk.callbacks.Logging([logger])])
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    stored = client.get_run(logger.run_id)
    assert stored.info.status == "FINISHED"
    assert stored.data.params["batch_size"] == "16" and stored.data.params["model"] == "MLP"
    assert stored.data.params["optimizer/learning_rate"] == "0.01"
    assert int(stored.data.params["parameters"]) == sum(np.size(a) for a in __import__("jax").tree.leaves(run.params))
    for name in ("loss", "val_loss", "accuracy", "val_accuracy"):
        values = client.get_metric_history(logger.run_id, name)
        assert [m.step for m in values] == [6, 12, 18]  # the global step at each epoch end
        np.testing.assert_allclose([m.value for m in values], history.history[name], rtol=1e-6)
    assert len(client.get_metric_history(logger.run_id, "examples_per_second")) == 3


def wandb_records(path):
    """The protobuf records of a W&B run file (LevelDB's log format: 32 KiB blocks of
    ``crc32, length, type`` headers after a 7-byte W&B header), parsed with wandb's own schema."""
    import struct

    from wandb.proto import wandb_internal_pb2

    raw, position, pending = open(path, "rb").read(), 7, b""
    assert raw[:4] == b":W&B"
    while position + 7 <= len(raw):
        left = 32768 - position % 32768
        _, length, kind = struct.unpack("<IHB", raw[position : position + 7])
        if left < 7 or (length == 0 and kind == 0):
            position += left
            continue
        if position + 7 + length > len(raw):
            return  # a record still being written
        data, position = raw[position + 7 : position + 7 + length], position + 7 + length
        pending = data if kind in (1, 2) else pending + data
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def test_wandb_offline_run_is_read_back_from_its_file(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = tk.loggers.WandbLogger(project="trainkit-test", dir=tmp_path)
    _, history = fit([tk.callbacks.Logging([logger])], epochs=2)
    files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    # wandb-core (its own process) may still be writing the file's tail when finish() returns
    # (seen in CI and here, about one run in ten): read it once its exit record is there.
    deadline, kinds = time.monotonic() + 30, []
    while kinds[-1:] != ["exit"]:
        assert time.monotonic() < deadline, collections.Counter(kinds)
        time.sleep(0.1)
        records = list(wandb_records(files[0]))
        kinds = [r.WhichOneof("record_type") for r in records]
    rows = [
        {item.nested_key[0]: json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [row["_step"] for row in rows] == [6, 12]
    for name in ("loss", "val_loss", "accuracy"):
        np.testing.assert_allclose([row[name] for row in rows], history.history[name], rtol=1e-6)
    config = next(r.config for r in records if r.WhichOneof("record_type") == "config")
    assert {"batch_size", "strategy", "optimizer/learning_rate"} <= {u.key for u in config.update}


def test_csv_logger_and_a_plugin_logger_see_every_step(tmp_path):
    seen = []

    class Collect:
        def log_metrics(self, step, metrics, run="train"):
            seen.append((step, run, sorted(metrics)))

        def log_hparams(self, config):
            seen.append(("hparams", config["batch_size"]))

        def close(self):
            seen.append("closed")

    csv_logger = tk.loggers.CSVMetricsLogger(tmp_path / "metrics.csv")
    fit([tk.callbacks.Logging([csv_logger, Collect()], update_freq=3)], epochs=2)
    assert seen[0] == ("hparams", 16) and seen[-1] == "closed"
    train_steps = [s for s, run, names in seen[1:-1] if run == "train" and "goodput" not in names]
    assert train_steps == [3, 6, 9, 12]
    assert seen[-2][:2] == (12, "train") and "goodput/step" in seen[-2][2]  # the ledger, as fit ends
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert rows[0] == "step,run,name,value" and any(r.startswith("12,validation,loss,") for r in rows)
    assert json.loads((tmp_path / "hparams.json").read_text())["batch_size"] == 16
    with pytest.raises(TypeError, match="is not a logger"):
        tk.callbacks.Logging([object()])


def test_step_flops_and_mfu():
    run, _ = fit([], epochs=1)
    flops = tk.debug.step_flops(run)
    forward = 2 * 16 * (5 * 16 + 16 * 3)  # MLP 5-16-3 (conftest), batch 16: two matmuls
    assert 2.5 * forward < flops < 5 * forward  # forward, backward and the update
    model = tk.debug.model_step_flops(run)
    assert model == 3 * forward  # the model's own: its matmuls, three times the forward's
    meter = throughput.Meter(
        examples_per_step=16, flops_per_step=flops, peak_flops=flops * 100, model_flops_per_step=model
    )
    rates = meter.rates(steps=50, seconds=1.0)
    assert rates["examples_per_second"] == 800 and rates["hfu"] == pytest.approx(0.5)
    assert rates["mfu"] == pytest.approx(0.5 * model / flops)
    assert throughput.peak_flops("cpu") is None
    assert throughput.peak_flops("NVIDIA A100-SXM4-80GB", "float32") == 156e12
    assert throughput.peak_flops("TPU v5 lite", "bfloat16") == 197e12


def test_history_plot_and_the_plot_command_draw_one_line_per_series(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    from trainkit.monitoring import plot

    csv_path = tmp_path / "log.csv"
    board = tmp_path / "board"
    _, history = fit([tk.callbacks.CSVLogger(csv_path), tk.callbacks.TensorBoard(board)], epochs=3)
    figure = history.plot(tmp_path / "history.png")
    lines = {ax.get_title(): len(ax.get_lines()) for ax in figure.axes if ax.get_visible()}
    assert lines == {"loss": 2, "accuracy": 2}  # train and validation in each panel
    pixels = matplotlib.image.imread(tmp_path / "history.png")
    assert pixels.shape[0] > 100 and pixels[..., :3].std() > 0.05  # not blank
    for source in (csv_path, board):  # a Keras CSV log and a TensorBoard directory give the same curves
        series = plot.read_series(source)
        np.testing.assert_allclose(series["val_loss"], history.history["val_loss"], rtol=1e-6)
        assert plot.main([str(source), "-o", str(tmp_path / "cli.png")]) == 0
        assert (tmp_path / "cli.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="Nothing to plot"):
        plot.plot_curves({"epoch": [0, 1]}, tmp_path / "empty.png")


class FlakyLogger:
    """Raises ConnectionError from the ``fail_at``-th log_metrics call on (all of them: ``always``)."""

    def __init__(self, fail_at=2, always=False):
        self.calls, self.fail_at, self.always, self.closed = 0, fail_at, always, False

    def log_metrics(self, step, metrics, run="train"):
        self.calls += 1
        if self.always or self.calls == self.fail_at:
            raise ConnectionError("the server went away")

    def log_hparams(self, config):
        pass

    def close(self):
        self.closed = True


def test_a_failing_logger_is_warned_about_and_the_other_callbacks_go_on(tmp_path):
    """Logging([...]) before ModelCheckpoint, CSVLogger and BackupAndRestore: a ConnectionError at
    the end of epoch 2 aborted fit with the backup left at step 16 of 32."""
    x, y = make_classification(64)
    flaky = FlakyLogger(fail_at=2)
    backup = tmp_path / "backup"
    callbacks = [
        tk.callbacks.Logging([flaky]),
        tk.callbacks.ModelCheckpoint(tmp_path / "ck", monitor="loss"),
        tk.callbacks.CSVLogger(tmp_path / "log.csv"),
        tk.callbacks.BackupAndRestore(backup, delete_checkpoint=False),
    ]
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single")
    with pytest.warns(UserWarning, match=r"Logging: FlakyLogger.log_metrics failed \(ConnectionError: the server"):
        trainer.fit(x, y, batch_size=16, epochs=4, verbose=0, callbacks=callbacks)
    # kept after one failure: 4 epochs and the goodput ledger at the end
    assert trainer.global_step == 16 and flaky.calls == 5 and flaky.closed
    assert len((tmp_path / "log.csv").read_text().splitlines()) == 1 + 4
    assert saved_steps(backup) == [16] and saved_steps(tmp_path / "ck") == [16]


def test_a_logger_failing_again_and_again_is_dropped(tmp_path):
    x, y = make_classification(64)
    broken = FlakyLogger(always=True)
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single")
    with pytest.warns(UserWarning, match=r"without this logger \(3 failures in a row\)"):
        trainer.fit(x, y, batch_size=16, epochs=5, verbose=0, callbacks=[tk.callbacks.Logging([broken])])
    assert broken.calls == 3 and not broken.closed and trainer.global_step == 20


def test_mlflow_waits_are_bounded():
    pytest.importorskip("mlflow")
    import socket

    with socket.socket() as free:  # a port nothing listens on: mlflow retries for minutes
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"MLflow at 'http://127.0.0.1:{port}' \(starting the run\) did not finish"):
        tk.loggers.MLflowLogger(f"http://127.0.0.1:{port}", timeout=2)
    assert time.monotonic() - started < 10


def test_credentials_in_a_server_url_never_reach_a_message(tmp_path):
    pytest.importorskip("mlflow")
    for uri in ("unknownscheme://alice:s3cr3t@host/", "http://alice:s3cr3t@127.0.0.1:9/?token=t0k3n"):
        with pytest.raises((RuntimeError, TimeoutError)) as raised:
            tk.loggers.MLflowLogger(uri, timeout=1)
        shown = str(raised.value) + "".join(__import__("traceback").format_exception(raised.value))
        assert "alice:***@" in shown and "s3cr3t" not in shown and "t0k3n" not in shown, shown

    class Refused:
        def log_metrics(self, step, metrics, run="train"):
            raise ConnectionError("POST http://bob:hunter2@server/api?access_token=abc refused")

        def log_hparams(self, config):
            pass

        def close(self):
            pass

    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single")
    with pytest.warns(UserWarning, match=r"bob:\*\*\*@server/api\?access_token=\*\*\* refused") as caught:
        trainer.fit(X, Y, batch_size=16, epochs=1, verbose=0, callbacks=[tk.callbacks.Logging([Refused()])])
    assert not [w for w in caught if "hunter2" in str(w.message) or "abc" in str(w.message)]


def test_an_unwritable_profiler_log_dir_fails_before_the_first_step(tmp_path):
    (tmp_path / "file").write_text("")
    profiler = tk.callbacks.Profiler(tmp_path / "file" / "profile", steps=(3, 4))  # under a file: never writable
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single")
    with pytest.raises(ValueError, match=r"Profiler: the log directory .*profile' cannot be written"):
        trainer.fit(X, Y, batch_size=16, epochs=1, verbose=0, callbacks=[profiler])
    assert trainer.global_step == 0


@pytest.mark.parametrize("content", [b"", b"epoch,loss\n0,abc\n", bytes(range(256)) * 2, None])
def test_the_plot_command_names_a_file_it_cannot_read_in_one_line(tmp_path, content):
    import subprocess
    import sys

    path = tmp_path / "log.csv"
    if content is not None:
        path.write_bytes(content)
    result = subprocess.run(
        [sys.executable, "-m", "trainkit.plot", str(path), "-o", str(tmp_path / "o.png")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    lines = own_stderr_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"python -m trainkit.plot: cannot plot '{path}'"), result.stderr


@pytest.mark.parametrize("strategy", ["single", "dp", "fsdp", "hybrid"])
def test_the_compiled_step_is_counted_per_device_and_in_total_under_every_strategy(strategy):
    strategies = {
        "single": tk.SingleDevice,
        "dp": tk.DataParallel,
        "fsdp": lambda: tk.FSDP(min_shard_size=64),
        "hybrid": lambda: tk.Hybrid(data=2, fsdp=4, min_shard_size=64),
    }
    x, y = make_classification(64, features=64)
    trainer = tk.Trainer(
        Wide(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy=strategies[strategy]()
    )
    trainer.fit(x, y, batch_size=64, epochs=1, verbose=0)
    flops = tk.debug.compiled_step_flops(trainer)
    devices = 1 if strategy == "single" else 8
    assert flops.total == pytest.approx(flops.per_device * devices)
    forward = 2 * 64 * (64 * 256 + 256 * 256 + 256 * 8)  # three matmuls on the global batch
    assert 2.5 * forward < flops.total < 4 * forward, (flops, forward)  # forward, backward, update
    assert 0.8 < flops.recomputed < 1.3, flops


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(64)(nn.relu(nn.Dense(256)(x)))


class Blocks(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = x + Block()(x)
        return nn.Dense(8)(x)


def test_remat_shows_as_recomputed_work_in_the_compiled_count():
    x, y = make_classification(64, features=64)
    counts = {}
    for remat in (None, ["Block"]):
        trainer = tk.Trainer(
            Blocks(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single", remat=remat
        )
        trainer.fit(x, y, batch_size=64, epochs=1, verbose=0)
        counts["remat" if remat else "none"] = tk.debug.compiled_step_flops(trainer)
        counts["model remat" if remat else "model none"] = tk.debug.model_step_flops(trainer)
    # each block's forward once more, in the lowered step (jax.checkpoint's recomputation is in its
    # gradient) and in the compiled one: neither is the model's own count under remat
    assert counts["remat"].model > 1.1 * counts["none"].model, counts
    assert counts["remat"].total > 1.1 * counts["none"].total, counts
    assert 0.8 < counts["remat"].recomputed < 1.3, counts
    # the model's own count, which MFU divides by, is remat's and not: its matmuls, as the shapes say
    forward = 2 * 64 * (3 * (64 * 256 + 256 * 64) + 64 * 8)
    assert counts["model remat"] == counts["model none"] == 3 * forward, counts


def test_the_loggers_throughput_counts_the_compiled_step_where_mfu_is_known(tmp_path, monkeypatch):
    logging = tk.callbacks.Logging([tk.loggers.CSVMetricsLogger(tmp_path / "metrics.csv")])
    trainer, _ = fit([logging], epochs=1)
    assert logging.meter.flops_per_step == tk.debug.step_flops(trainer)  # a CPU: no peak, no second compile
    assert "tflops_per_second" in (tmp_path / "metrics.csv").read_text()
    monkeypatch.setattr(chips, "CHIPS", (*chips.CHIPS, chips.Chip("a CPU", ("cpu",), 1e12, 1e12)))  # a data sheet
    logging = tk.callbacks.Logging([tk.loggers.CSVMetricsLogger(tmp_path / "again.csv")])
    trainer, _ = fit([logging], epochs=1)
    assert logging.meter.flops_per_step == tk.debug.compiled_step_flops(trainer).total
    assert "mfu" in (tmp_path / "again.csv").read_text()


@pytest.mark.parametrize(
    "text, secret",
    [
        ("http://alice:p@ss@host:5000/api", "p@ss"),  # a raw @ in the password: the URL's last @ ends it
        ("GitLab said 401 for private_token=glpat-123abc", "glpat-123abc"),
        ("token endpoint: client_id=app&client_secret=s3cr3tv4lue", "s3cr3tv4lue"),
        ("headers {'Authorization: Bearer eyJhbGciOi.payload'}", "eyJhbGciOi.payload"),
        ("Authorization: Basic YWxpY2U6czNjcjN0", "YWxpY2U6czNjcjN0"),
        ("refresh_token=rt-987 expired", "rt-987"),
        ("env: HF_TOKEN=hf_AbC123 PATH=/usr/bin", "hf_AbC123"),  # #59's spellings
        ("AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG", "wJalrXUtnFEMI/K7MDENG"),
        ('config {"user": "alice", "password": "hunter2"}', "hunter2"),
        ("argv: train.py --token tk-live-42 --epochs 3", "tk-live-42"),
        ("argv: train.py --hf-token=hf_x9 --epochs 3", "hf_x9"),
        ("request headers: X-API-Key: ak_live_77", "ak_live_77"),
        ("Cookie: session=abc123; theme=dark", "session=abc123"),
    ],
)
def test_every_credential_spelling_is_masked(text, secret):
    from trainkit.core.redact import redacted

    shown = redacted(text)
    assert secret not in shown and "***" in shown, shown
    assert redacted("the token expired at the basic step") == "the token expired at the basic step"  # prose kept


def test_flops_are_counted_from_the_module_where_a_backend_reports_none():
    """A lowered step's own analysis (the CPU's here) and the CPU client's count of its HLO module
    agree; the second is what MFU falls back on where a backend's analysis has no flops (a TPU run
    of benchmarks/lm_mfu.py printed no MFU)."""
    import jax
    import jax.numpy as jnp

    from trainkit.internals.runtime import hlo_cost

    lowered = jax.jit(lambda a, b: jnp.tanh(a @ b)).lower(jnp.ones((16, 32)), jnp.ones((32, 8)))
    assert hlo_cost(lowered)["flops"] == lowered.cost_analysis()["flops"] >= 2 * 16 * 32 * 8


def test_the_progress_bar_and_the_goodput_summary_show_mfu_where_the_peak_is_known(monkeypatch):
    """A TPU's kind is in the peak table ("TPU v5 lite"); a CPU's is not, so the CPU is given a
    peak here: the live rate and the summary then show MFU, and without one neither does."""
    import io

    from rich.console import Console

    def shown(peaks):
        monkeypatch.setattr(chips, "CHIPS", tuple(chips.Chip(kind, (kind,), *flops) for kind, flops in peaks.items()))
        out = io.StringIO()
        bar = tk.callbacks.ProgressBar(verbose=1, console=Console(file=out, force_terminal=True, width=200))
        trainer().fit(X, Y, batch_size=16, epochs=2, verbose=0, callbacks=[bar])
        return out.getvalue()

    with_peak = shown({"cpu": (1e9, 1e9)})
    mfu = [float(m) for m in re.findall(r"MFU (\d+\.\d)% at the median step", with_peak)]
    assert len(mfu) == 1 and mfu[0] > 0, with_peak
    assert re.search(r"steps/s, [\d,]+ examples/s, MFU \d+\.\d%", with_peak), with_peak
    assert "MFU" not in shown({})
