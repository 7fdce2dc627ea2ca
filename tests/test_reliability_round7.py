"""Reliability, seventh round (#70): a published base never replaced, no file turned into a folder,
no weight read from outside its folder, URLs refused however they are spelled, and the errors of
round seven named."""

import json
import os
import pathlib

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
import safetensors.numpy

import trainkit as tk
from trainkit.core.local_path import require_local
from trainkit.core.redact import redacted

X = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
Y = (X.sum(axis=1) > 0).astype(np.int32)
CONFIG = {"model_type": "tiny", "architectures": ["TinyModel"]}


@pytest.fixture(autouse=True)
def architecture_unchecked(monkeypatch):
    """These tests are of the folders' rules: the config's architecture (checked against transformers'
    model where it is installed, tests/test_save_pretrained.py) is left unchecked, as without it."""
    from trainkit.weights import architecture

    monkeypatch.setattr(architecture, "expected_shapes", lambda config: None)
    monkeypatch.setattr(architecture, "check", lambda shapes, config: None)


@pytest.fixture(scope="module")
def trainer():
    trainer = tk.Trainer(
        nn.Dense(2), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single"
    )
    trainer.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    return trainer


def published(folder: pathlib.Path, trainer) -> pathlib.Path:
    trainer.save_pretrained(folder, config=CONFIG)
    return folder


def snapshot(folder: pathlib.Path) -> dict:
    return {str(path): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.parametrize(
    "source", ["config.json", ".", "..", "tokenizer"], ids=["config_file", "folder", "above", "inside"]
)
def test_save_pretrained_never_writes_where_a_source_lies(trainer, tmp_path, source):
    base = published(tmp_path / "base", trainer)
    (base / "tokenizer.json").write_text("{}")
    (base / "tokenizer").mkdir()
    (base / "tokenizer" / "tokenizer.json").write_text("{}")
    before = snapshot(base)
    argument = {"config": str(base / "config.json")}
    target = base
    if source == "..":
        argument, target = {"config": str(base)}, base / "finetuned"  # written into the base folder
    elif source == "tokenizer":
        argument = {"config": CONFIG, "tokenizer": str(base / "tokenizer")}
    elif source == ".":
        argument = {"config": str(base)}
    with pytest.raises(ValueError, match=r"save_pretrained would write .*what (config|tokenizer)= reads.*Nothing was"):
        trainer.save_pretrained(target, **argument)
    assert snapshot(base) == before


def test_save_pretrained_never_writes_over_the_weights_it_was_loaded_from(trainer, tmp_path):
    base = published(tmp_path / "base", trainer)
    tk.weights.load(base, into=trainer)
    with pytest.raises(ValueError, match=r"which is what tk.weights.load\(...\) reads"):
        trainer.save_pretrained(base, config=CONFIG)
    trainer.save_pretrained(tmp_path / "beside", config=CONFIG)  # a new folder: fine


def writers(trainer, path):
    """Every writer of a folder trainkit has, by name: each writes ``path``."""
    return {
        "save": lambda: trainer.save(path),
        "save_pretrained": lambda: trainer.save_pretrained(path, config=CONFIG),
        "backup_and_restore": lambda: trainer.fit(
            X, Y, batch_size=16, verbose=0, callbacks=[tk.callbacks.BackupAndRestore(path)]
        ),
        "model_checkpoint": lambda: trainer.fit(
            X, Y, batch_size=16, verbose=0, callbacks=[tk.callbacks.ModelCheckpoint(path)]
        ),
        "tensorboard": lambda: trainer.fit(X, Y, batch_size=16, verbose=0, callbacks=[tk.callbacks.TensorBoard(path)]),
    }


@pytest.mark.parametrize("writer", ["save", "save_pretrained", "backup_and_restore", "model_checkpoint", "tensorboard"])
def test_no_writer_turns_an_existing_file_into_a_folder(trainer, tmp_path, writer):
    notes = tmp_path / "results.txt"
    notes.write_text("the user's own")
    with pytest.raises((FileExistsError, ValueError, tk.CheckpointError), match=r"results.txt.*existing file, not a"):
        writers(trainer, notes)[writer]()
    assert notes.read_text() == "the user's own"


def test_an_export_folder_onto_a_file_is_refused_by_the_same_rule(tmp_path):
    from trainkit.distributed import atomic

    notes = tmp_path / "notes"
    notes.write_text("mine")
    with pytest.raises(FileExistsError, match=r"export's 'tf_saved_model' folder .*notes.*existing file"):
        with atomic.staged(notes, folder="export's 'tf_saved_model' folder") as temporary:
            os.makedirs(temporary)
    assert notes.read_text() == "mine"


def shards_folder(tmp_path, trainer, name_of_shard) -> pathlib.Path:
    """A folder of one shard and an index whose weight_map names ``name_of_shard`` for every entry."""
    folder = tmp_path / "model"
    folder.mkdir()
    arrays = {k: np.asarray(v) for k, v in trainer.state_access.named_weights().items()}
    safetensors.numpy.save_file(arrays, str(folder / "model-00001-of-00001.safetensors"))
    index = {"metadata": {}, "weight_map": {name: name_of_shard for name in arrays}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize("name", ["../outside/x.safetensors", "/etc/passwd", "sub/x.safetensors"])
def test_an_index_naming_a_shard_outside_its_folder_is_refused_before_it_is_opened(trainer, tmp_path, name):
    outside = tmp_path / "outside"
    outside.mkdir()
    folder = shards_folder(tmp_path, trainer, name)
    with pytest.raises(tk.weights.WeightFileError, match=r"a shard is a file name inside the folder"):
        tk.weights.load(folder, into=trainer)


@pytest.mark.parametrize("target", ["folder", "fifo"])
def test_a_shard_linked_to_what_is_not_a_file_is_refused(trainer, tmp_path, target):
    """#81 (FL9) replaced round seven's rule: a link to a regular file is read wherever it leads (a Hugging
    Face cache); a link to a folder or a pipe is refused before it is opened (a pipe would block the read)."""
    planted = tmp_path / "planted"
    planted.mkdir()
    if target == "fifo":
        os.mkfifo(planted / "x.safetensors")
    else:
        (planted / "x.safetensors").mkdir()
    folder = shards_folder(tmp_path, trainer, "linked.safetensors")
    (folder / "linked.safetensors").symlink_to(planted / "x.safetensors")
    before = trainer.get_weights()
    with pytest.raises(tk.weights.WeightFileError, match=r"linked.safetensors links to .* not a regular file"):
        tk.weights.load(folder, into=trainer)
    (folder / "model.safetensors.index.json").unlink()
    (folder / "model-00001-of-00001.safetensors").unlink()
    with pytest.raises(tk.weights.WeightFileError, match=r"not a regular file"):  # a folder of shards alone
        tk.weights.load(folder, into=trainer)
    np.testing.assert_array_equal(trainer.get_weights()["params"]["kernel"], before["params"]["kernel"])


def test_a_deeply_nested_index_is_named(trainer, tmp_path):
    folder = shards_folder(tmp_path, trainer, "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text("[" * 100_000)
    with pytest.raises(tk.weights.WeightFileError, match=r"model.safetensors.index.json.*nested too deeply"):
        tk.weights.load(folder, into=trainer)


@pytest.mark.parametrize(
    "spelled",
    [pathlib.Path("s3://bucket/run"), "s3:/bucket/run", " gs://bucket/run", "gs://bucket/run ", "HDFS://host/run"],
    ids=["path", "one_slash", "leading_space", "trailing_space", "upper"],
)
def test_a_url_is_refused_however_it_is_spelled(spelled):
    with pytest.raises(ValueError, match=r"is a (s3|gs|HDFS):// URL"):
        require_local(spelled, "save's filepath")
    assert require_local("C:/runs", "save's filepath") == "C:/runs"  # a drive letter is a path


def test_a_credential_in_a_collapsed_url_or_a_webhook_is_never_printed():
    with pytest.raises(ValueError) as refused:
        require_local(pathlib.Path("s3://alice:s3cr3t@bucket/run"), "save's filepath")
    assert "s3cr3t" not in str(refused.value)
    assert "XXXsecret" not in redacted("posting to https://hooks.slack.com/services/T01/B02/XXXsecret failed")


def test_a_readme_trainkit_did_not_write_is_kept(trainer, tmp_path):
    folder = published(tmp_path / "model", trainer)
    (folder / "README.md").write_text("# my model card")
    trainer.save_pretrained(folder, config=CONFIG)
    assert (folder / "README.md").read_text() == "# my model card"


@pytest.mark.parametrize(("spelled", "written"), [("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")])
def test_save_pretrained_reads_the_usual_dtype_spellings(trainer, tmp_path, spelled, written):
    trainer.save_pretrained(tmp_path / spelled, config=CONFIG, dtype=spelled)
    assert json.loads((tmp_path / spelled / "config.json").read_text())["dtype"] == written


def test_an_unknown_dtype_or_a_config_json_cannot_hold_is_named(trainer, tmp_path):
    with pytest.raises(ValueError, match=r"dtype=5 is not a floating dtype.*'bf16'"):
        trainer.save_pretrained(tmp_path / "a", config=CONFIG, dtype=5)
    with pytest.raises(TypeError, match=r"config= holds 'labels': set.*Nothing was written"):
        trainer.save_pretrained(tmp_path / "b", config={**CONFIG, "labels": {1, 2}})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_plan_command_names_a_script_attribute_that_is_no_function(tmp_path):
    from trainkit.__main__ import load_function

    script = tmp_path / "script.py"
    script.write_text("make_trainer = 5\n")
    with pytest.raises(SystemExit, match=r"script.py:make_trainer is a int, not a function"):
        load_function(f"{script}:make_trainer")


def test_a_restore_into_another_hybrid_mesh_of_as_many_devices_is_said(caplog):
    from trainkit.checkpoint import explain_restore

    into = tk.Hybrid(data=2, fsdp=4)
    written = {"device_count": 8, "strategy": "Hybrid", "strategy_description": "Hybrid(data=2, context=4)",
               "mesh": {"data": 2, "context": 4}, "position": {"global_step": 3}}  # fmt: skip
    with caplog.at_level("WARNING", logger="trainkit"):
        explain_restore(written, into, None)
        explain_restore({**written, "mesh": {k: int(v) for k, v in into.mesh.shape.items()}}, into, None)
    said = [r.getMessage() for r in caplog.records if "Restored step 3" in r.getMessage()]
    assert len(said) == 1 and "(mesh {'data': 2, 'context': 4} -> " in said[0] and "not bit for bit" in said[0]
    assert "dropout draws its masks per device" in said[0]


def test_a_second_process_0_is_told_its_index_may_be_given_twice():
    import socket

    from trainkit.distributed import joining

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(RuntimeError, match=r"another process 0 of this job \(an index given twice.*SLURM_PROCID"):
            joining.check_port_free(f"127.0.0.1:{port}")


class FrozenBodyNorm(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(8, name="body")(x)
        x = nn.BatchNorm(use_running_average=not train, use_bias=False, use_scale=False, name="norm")(x)
        return nn.Dense(2, name="head")(x)


def nnx_frozen_body_norm():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.body = nnx.Linear(4, 8, rngs=rngs)
            self.norm = nnx.BatchNorm(8, use_bias=False, use_scale=False, rngs=rngs)
            self.head = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.head(self.norm(self.body(x)))

    return Model(nnx.Rngs(0))


@pytest.mark.parametrize("make", [FrozenBodyNorm, nnx_frozen_body_norm], ids=["linen", "nnx"])
def test_a_parameter_free_batchnorm_after_a_frozen_layer_keeps_its_statistics(make):
    trainer = tk.Trainer(make(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2), strategy="single",
                         trainable=r"^head/")  # fmt: skip
    trainer.init((X, Y))
    before = {k: v for k, v in trainer.get_weights().items() if k != "params"}
    trainer.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    after = {k: v for k, v in trainer.get_weights().items() if k != "params"}
    assert jax.tree.leaves(before)
    jax.tree.map(np.testing.assert_array_equal, after, before)
