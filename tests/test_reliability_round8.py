"""Reliability, eighth round (#81): Hugging Face cache folders load, and the round's other rows."""

import hashlib
import inspect
import json
import logging
import pathlib
import re
import time

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
import safetensors.numpy

import trainkit as tk

X = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
Y = (X.sum(axis=1) > 0).astype(np.int32)
CONFIG = {"model_type": "tiny", "architectures": ["TinyModel"]}


@pytest.fixture
def trainer():
    trainer = tk.Trainer(
        nn.Dense(2), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single"
    )
    trainer.init(X[:1])
    return trainer


def cached(repo: pathlib.Path, files: dict[str, bytes], revision: str = "0123abcd") -> pathlib.Path:
    """``files`` laid out as ``huggingface_hub`` caches a download: each file's bytes in
    ``blobs/<sha256>``, and ``snapshots/<revision>/<name>`` a relative link to its blob."""
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    for name, content in files.items():
        digest = hashlib.sha256(content).hexdigest()
        (repo / "blobs" / digest).write_bytes(content)
        (snapshot / name).symlink_to(pathlib.Path("..") / ".." / "blobs" / digest)
    return snapshot


def weights_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    return safetensors.numpy.save(arrays)


@pytest.mark.parametrize("sharded", [False, True], ids=["single_file", "sharded"])
def test_a_hugging_face_cache_snapshot_loads(trainer, tmp_path, sharded):
    """FL9: a cache snapshot whose files link to ../../blobs/<sha> is read (it was refused as leading
    outside the folder), one file or shards through their index."""
    kernel, bias = np.full((4, 2), 0.25, np.float32), np.full((2,), -0.5, np.float32)
    if sharded:
        index = {"metadata": {}, "weight_map": {"kernel": "model-00001-of-00002.safetensors",
                                                 "bias": "model-00002-of-00002.safetensors"}}  # fmt: skip
        files = {
            "model-00001-of-00002.safetensors": weights_bytes({"kernel": kernel}),
            "model-00002-of-00002.safetensors": weights_bytes({"bias": bias}),
            "model.safetensors.index.json": json.dumps(index).encode(),
        }
    else:
        files = {"model.safetensors": weights_bytes({"kernel": kernel, "bias": bias})}
    snapshot = cached(tmp_path / "models--someone--tiny", files | {"config.json": b"{}"})
    tk.weights.load(snapshot, into=trainer)
    np.testing.assert_array_equal(trainer.get_weights()["params"]["kernel"], kernel)
    np.testing.assert_array_equal(trainer.get_weights()["params"]["bias"], bias)


# ---------------------------------------------------------------- SE4: every path goes through one URL check
SECRET_URL = "s3://AKIAEXAMPLE:pw-s3cr3t@bucket/run/x.csv"
PATH_NAMES = re.compile(r"(^|_)(dir|path|filepath|filename|folder|directory|file)$")


def path_arguments() -> set[str]:
    """Every argument of the public API named as a file system path: ``Owner.method(argument)``."""
    from trainkit.callbacks.lr_finder import LearningRateSearch

    owners: list[tuple[str, object]] = [("Trainer", tk.Trainer), ("LearningRateSearch", LearningRateSearch)]
    for module in (tk.callbacks, tk.weights, tk.export):
        owners += [(name, getattr(module, name)) for name in module.__all__]
    owners += [(name, obj) for name, obj in vars(tk.loggers).items() if inspect.isclass(obj) and obj.__module__ ==
               tk.loggers.__name__ and not name.startswith("_")]  # fmt: skip
    found = set()
    for name, owner in owners:
        members = [(name, owner)]
        if inspect.isclass(owner):
            members += [(f"{name}.{m}", f) for m, f in inspect.getmembers(owner, inspect.isfunction) if m[0] != "_"]
        for label, member in members:
            try:
                parameters = inspect.signature(member).parameters  # type: ignore[arg-type]
            except (TypeError, ValueError):
                continue
            found |= {f"{label}({p})" for p in parameters if PATH_NAMES.search(p)}
    return found


def fitted() -> tk.Trainer:
    trainer = tk.Trainer(
        nn.Dense(2), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single"
    )
    trainer.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    return trainer


def calls(url: str) -> dict[str, object]:
    """Each path argument given ``url``: a function that raises the URL's error (or does not)."""
    from trainkit.callbacks.lr_finder import LearningRateSearch

    cb, loggers = tk.callbacks, tk.loggers
    spec = {"x": ((3,), "float32")}
    search = LearningRateSearch([1e-3, 1e-2], [1.0, 0.5], [1.0, 0.5], 1e-3, stopped_early=False)
    return {
        "Trainer.export(filepath)": lambda: fitted().export(url),
        "Trainer.load(directory)": lambda: fitted().load(url),
        "Trainer.save(filepath)": lambda: fitted().save(url),
        "Trainer.save_pretrained(folder)": lambda: fitted().save_pretrained(url, config=CONFIG),
        "Trainer.save_weights(filepath)": lambda: fitted().save_weights(url),
        "BackupAndRestore(backup_dir)": lambda: cb.BackupAndRestore(url),
        "CSVLogger(filename)": lambda: cb.CSVLogger(url),
        "GradientStats(log_dir)": lambda: cb.GradientStats(log_dir=url),
        "History.plot(path)": lambda: cb.History().plot(url),
        "ModelCheckpoint(filepath)": lambda: cb.ModelCheckpoint(url),
        "Profiler(log_dir)": lambda: cb.Profiler(url, steps=(1, 2)),
        "TensorBoard(log_dir)": lambda: cb.TensorBoard(url),
        "LearningRateSearch.plot(path)": lambda: search.plot(url),
        "LoadedModel(path)": None,  # the label of a model load() read
        "export(path)": lambda: tk.export.export(url, lambda: (lambda w, x: x, 1.0, spec)),
        "load(path)": lambda: tk.export.load(url),
        "resolve_format(path)": lambda: tk.export.resolve_format(url, None),
        "write(path)": lambda: tk.export.write(url, lambda w, x: x, 1.0, spec, "jax", verbose=False),
        "save(path)": lambda: tk.weights.save({"w": np.zeros(2, np.float32)}, url),
        "save_pretrained(folder)": lambda: tk.weights.save_pretrained(fitted().state_access, url, config=CONFIG),
        "Loadable.put_weights(path)": None,  # a protocol's member: the path is the one load() checked
        "TensorBoardLogger(log_dir)": lambda: loggers.TensorBoardLogger(url),
        "CSVMetricsLogger(path)": lambda: loggers.CSVMetricsLogger(url),
        "WandbLogger(dir)": lambda: loggers.WandbLogger(dir=url, mode="disabled"),
    }


def test_every_path_argument_of_the_public_api_is_listed():
    """A new path argument must join ``calls`` (and so the URL check): the list is the API's own."""
    assert path_arguments() == set(calls(SECRET_URL)), "add the new path argument to calls() above"


@pytest.mark.parametrize("argument", sorted(calls(SECRET_URL)))
def test_a_url_is_refused_by_every_path_argument_with_its_secret_masked(argument, tmp_path, monkeypatch):
    """SE4: GradientStats, Profiler and CSVLogger took a URL for a local folder (``https:/user:pw@host``
    written) or printed its password; every path now goes through ``require_local``."""
    call = calls(SECRET_URL)[argument]
    if call is None:
        pytest.skip("not a path trainkit opens")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"is a s3:// URL") as raised:
        call()
    assert "s3cr3t" not in str(raised.value)
    assert not any(tmp_path.rglob("*")), "nothing may be written for a URL"


# ---------------------------------------------------------------- AT14: causal tk.attention under a context axis
class CausalAttention(nn.Module):
    """One causal ``tk.attention`` layer: ``"alibi"`` (a bias), ``"cross"`` (16 queries on the first 8
    positions' keys) or ``"twelve"`` (self-attention of 12 positions: chunks of 3 that do not halve)."""

    variant: str

    @nn.compact
    def __call__(self, tokens):
        import jax.numpy as jnp

        x = nn.Embed(16, 16)(tokens)
        b, t, _ = x.shape
        q = nn.Dense(16)(x).reshape(b, t, 2, 8)
        memory = x[:, :8] if self.variant == "cross" else x
        k, v = (nn.Dense(16)(memory).reshape(b, memory.shape[1], 2, 8) for _ in range(2))
        bias = None
        if self.variant == "alibi":
            distance = jnp.arange(t)[None, :] - jnp.arange(t)[:, None]
            bias = (jnp.array([0.5, 0.25])[:, None, None] * jnp.minimum(distance, 0))[None]  # (1, heads, t, t)
        causal = (
            "top_left" if self.variant == "cross" else True
        )  # #83: a causal call over fewer keys says how it aligns
        attended = tk.attention(q, k, v, causal=causal, bias=bias)
        return nn.Dense(16)(attended.reshape(b, t, 16))


@pytest.mark.parametrize("variant, length", [("alibi", 16), ("cross", 16), ("twelve", 12)])
def test_causal_attention_under_a_context_axis_trains_as_on_one_device(variant, length):
    """AT14: each raised trainkit's own TypeError (the mask passed twice to the split attention)."""
    from conftest import check_trains_like_single_device

    tokens = np.random.default_rng(1).integers(0, 16, size=(8, length + 1)).astype(np.int32)

    def make(strategy):
        model = CausalAttention(variant)
        return tk.Trainer(model, loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy=strategy)

    x, y = tokens[:, :-1], tokens[:, 1:]
    check_trains_like_single_device(make, tk.Hybrid(data=2, context=4), x, y, batch_size=4, steps=2)


def test_the_docs_give_tk_attentions_own_defaults():
    """AT2: docs/large_models.md gave ``causal=True`` as the default; the code's is False."""
    text = (pathlib.Path(__file__).parent.parent / "docs" / "large_models.md").read_text()
    documented = re.search(r"`tk\.attention\(query, key, value, ([^`]*)\)`", text)
    assert documented is not None
    defaults = dict(part.split("=") for part in documented[1].split(", "))
    actual = {
        n: repr(p.default) for n, p in inspect.signature(tk.attention).parameters.items() if p.default is not p.empty
    }
    assert defaults == actual


# ---------------------------------------------------------------- SE8 / SE9 / SP2: credentials kept out of messages
@pytest.mark.parametrize(
    "text, secret",
    [
        ("token ghp_0123456789abcdefghijABCDEFGHIJ012345 rejected", "ghp_0123456789"),
        ("github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz in the remote", "github_pat_11"),
        ("POST https://api.telegram.org/bot123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw0/sendMessage", "AAHdqTcv"),
        ("chat 987654321:AAE-abcdefghijklmnopqrstuvwxyz0123456 said", "AAE-abcdef"),
    ],
)
def test_bare_tokens_are_masked(text, secret):
    from trainkit.core.redact import redacted

    assert secret not in redacted(text) and "***" in redacted(text)


def test_a_password_in_the_coordinator_address_is_never_printed():
    """SE8: ``JAX_COORDINATOR_ADDRESS=alice:s3cr3t@node0:1234`` was printed whole in the join's error."""
    from trainkit.distributed import joining

    with pytest.raises(RuntimeError, match=r"'\*\*\*@node0:1234' does not resolve") as raised:
        joining.resolved("alice:s3cr3t@node0:1234")
    assert "s3cr3t" not in str(raised.value)


# ---------------------------------------------------------------- OM5 / OM11: out-of-memory messages
def test_with_no_batch_that_fits_the_message_does_not_point_at_one(monkeypatch):
    """OM5: the message ended "fits at the batch named above" though none was named."""
    monkeypatch.setenv("TRAINKIT_DEVICE_MEMORY", "1024")
    x = np.random.default_rng(0).normal(size=(64, 32)).astype(np.float32)
    trainer = tk.Trainer(nn.Dense(64), loss="mse", optimizer=optax.adam(1e-3), strategy="single")
    with pytest.raises(tk.OutOfMemory) as raised:
        trainer.fit(x, np.zeros((64, 64), np.float32), batch_size=8, verbose=0)
    text = str(raised.value)
    assert raised.value.fits_at is None and "no smaller batch fits" in text
    assert "named above" not in text and "fits once the model, its precision or the strategy change" in text


class RaisesAtStep2(tk.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            raise RuntimeError("CUDA out of memory in my callback's own torch model")


def out_of_memory_batches():
    for index in range(4):
        if index == 2:
            raise RuntimeError("DataLoader worker: out of memory decoding image 17")
        yield X[:8], Y[:8]


@pytest.mark.parametrize("where", ["callback", "data"])
def test_a_memory_error_of_the_data_or_a_callback_is_not_the_devices(where):
    """OM11: a callback's or the data's RuntimeError mentioning "out of memory" became the train step's
    tk.OutOfMemory, its own note lost; only the device's RESOURCE_EXHAUSTED is renamed now."""
    trainer = tk.Trainer(
        nn.Dense(2), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single"
    )
    if where == "callback":
        run = lambda: trainer.fit(X, Y, batch_size=8, verbose=0, callbacks=[RaisesAtStep2()])  # noqa: E731
    else:
        run = lambda: trainer.fit(out_of_memory_batches(), verbose=0)  # noqa: E731
    with pytest.raises(RuntimeError) as raised:
        run()
    assert not isinstance(raised.value, tk.OutOfMemory), raised.value
    assert "out of memory" in str(raised.value)
    if where == "data":
        assert any("raised by the data while reading batch 2" in note for note in raised.value.__notes__)


def test_an_empty_batch_mid_stream_is_named_as_such():
    """IN4: it was reported as "the dataset is empty"."""
    batches = [(X[:8], Y[:8]), (X[:0], Y[:0]), (X[8:16], Y[8:16])]
    trainer = tk.Trainer(
        nn.Dense(2), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single"
    )
    with pytest.raises(ValueError, match=r"Batch 1 of the iterable has 0 rows \(its first had 8\)") as raised:
        trainer.fit(batches, epochs=1, verbose=0)
    assert "dataset is empty" not in str(raised.value)


@pytest.mark.parametrize("what", ["save_weights", "export"])
def test_a_failed_write_names_the_target_not_its_staging_file(what, tmpfs):
    """FL8: a full disk's OSError named the hidden ``.<name>.writing-...`` file trainkit wrote to."""
    trainer = tk.Trainer(nn.Dense(1024), loss="mse", optimizer=optax.sgd(0.1), strategy="single")
    trainer.init(np.zeros((1, 1024), np.float32))  # 4 MiB of weights on a 4 MiB disk
    target = tmpfs / ("model.safetensors" if what == "save_weights" else "model.jax")
    with pytest.raises(OSError) as raised:
        getattr(trainer, what)(target)
    assert str(target) in str(raised.value) and ".writing-" not in str(raised.value), raised.value
    assert not any(tmpfs.iterdir())  # nothing left behind


def test_a_planted_step_link_is_named_not_taken_for_a_full_disk(tmp_path):
    """FL5: a symbolic link at a step's path made ModelCheckpoint stop the fit with "free disk space" advice."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    (directory / "4").symlink_to(elsewhere)  # 32 rows in batches of 8: epoch 1 ends at step 4
    trainer = tk.Trainer(
        nn.Dense(2), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single"
    )
    with pytest.raises(tk.CheckpointError, match=r"Step 4 would be written at .*4, which is already there as a "
                       r"symbolic link to .*elsewhere, not a checkpoint") as raised:  # fmt: skip
        trainer.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[tk.callbacks.ModelCheckpoint(directory)])
    assert "Free disk space" not in str(raised.value) and not any(elsewhere.iterdir())


@pytest.mark.parametrize("config", ["folder", "file"])
def test_save_pretrained_inside_the_base_is_refused_however_the_config_is_named(tmp_path, config):
    """SP1: ``config=<base>`` refused a target inside the base, ``config=<base>/config.json`` let it be written."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(CONFIG))
    trainer = tk.Trainer(
        nn.Dense(2), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single"
    )
    trainer.init(X[:1])
    source = base if config == "folder" else base / "config.json"
    with pytest.raises(ValueError, match=r"save_pretrained would write .*sub'?, which lies inside what config= reads"):
        trainer.save_pretrained(base / "sub", config=source)
    assert not (base / "sub").exists()


# ---------------------------------------------------------------- a new user's habits in a step of their own
class TwoInputs(nn.Module):
    @nn.compact
    def __call__(self, first, second):
        return nn.Dense(2)(first) + nn.Dense(2)(second)


def test_a_model_of_two_arguments_given_a_tuple_is_told_how_the_tuple_arrives():
    trainer = tk.Trainer(
        TwoInputs(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single"
    )
    with pytest.raises(
        ValueError, match=r"(?s)missing 1 required positional argument.*reaches the model as ONE argument"
    ):
        trainer.fit((X, X), Y, batch_size=8, verbose=0)


class OwnStep(tk.Trainer):
    mistake = "normal"

    def train_step(self, state, batch, rng):
        if self.mistake == "normal":
            state.normal(rng, (4,))  # the batch left out
        params = state.params

        def loss(params_given):  # reads state.params, not its argument
            logits, _ = state.apply(params, state.model_state, batch["x"], rng=rng, train=True)
            return state.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), batch)

        grads = jax.grad(loss)(params)
        return state.apply_gradients(grads), {}


@pytest.mark.parametrize("mistake, says", [
    ("normal", r"state.normal\(rng, batch, shape\) takes the step's batch second"),
    ("closure", r"all zero on the first batch: the loss they are the gradients of does not depend on them\. Most "
                r"often a loss function that reads state.params"),
])  # fmt: skip
def test_a_users_step_mistake_is_named_with_its_fix(mistake, says):
    """state.normal(rng, shape) was a raw TypeError from inside trainkit; a loss closing over state.params got
    advice about optimizer groups the trainer does not have."""
    trainer = OwnStep(nn.Dense(2), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single")
    trainer.mistake = mistake
    with pytest.raises((TypeError, ValueError), match=says):
        trainer.fit(X, Y, batch_size=8, verbose=0)


# ---------------------------------------------------------------- SE2 / SE9: tracking servers' credentials
def test_a_tracking_library_retry_warning_is_masked(caplog, tmp_path):
    """SE2: urllib3's retries in MLflow's thread logged the tracking URL with its ?token=."""
    pytest.importorskip("mlflow")
    tk.loggers.MLflowLogger(f"sqlite:///{tmp_path / 'runs.db'}").close()  # installs the masking
    with caplog.at_level("WARNING"):
        logging.getLogger("urllib3.connectionpool").warning(
            "Retrying (Retry(total=4)) after connection broken by '%s': %s",
            "NewConnectionError",
            "/api/2.0/mlflow/runs/get?run_id=3&token=s3cr3t-token",
        )
    (record,) = [r for r in caplog.records if r.name == "urllib3.connectionpool"]
    assert "s3cr3t-token" not in record.getMessage() and "token=***" in record.getMessage()


def test_an_unreachable_wandb_server_is_bounded_and_its_password_masked(tmp_path, monkeypatch):
    """SE9: WandbLogger online with an unreachable server ran past 90 s; the error now comes within the
    timeout (wandb's init_timeout and its own retry) without the base URL's password."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_BASE_URL", "http://alice:pw-s3cr3t@127.0.0.1:9")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_SILENT", "true")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"W&B \(online\) could not start the run") as raised:
        tk.loggers.WandbLogger(dir=tmp_path, mode="online", timeout=2)
    assert time.monotonic() - start < 60
    assert "pw-s3cr3t" not in str(raised.value)
