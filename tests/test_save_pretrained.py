"""``trainer.save_pretrained`` (#61): a fine-tuned model as a folder Hugging Face's readers take as it
is, run against the real ``transformers`` and ``peft`` (tiny random configs made here, nothing from a
hub): docs/finetuning.md's GPT-2 loaded from a ``save_pretrained`` folder, fine-tuned under FSDP on 8
devices, written back; ``AutoModelForCausalLM.from_pretrained`` gives trainkit's logits and greedy
tokens; shards with their index, bf16, a PEFT folder of LoRA's adapters, and the refusals before
anything is written."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from conftest import run_guide

import trainkit as tk

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

GUIDE = pathlib.Path(__file__).parent.parent / "docs" / "finetuning.md"
TOKENS = np.random.default_rng(1).integers(0, 64, size=(16, 33)).astype(np.int32)


@pytest.fixture(scope="module")
def recipes() -> dict:
    """The guide's first three blocks run as written (the imports, the GPT-2 and Llama recipes)."""
    return run_guide(GUIDE, first=3)


def published(folder: pathlib.Path, model) -> pathlib.Path:
    """A published tiny model: ``save_pretrained``'s folder with a real (word-level) tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    model.save_pretrained(folder)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> pathlib.Path:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, n_positions=32, vocab_size=64)
    return published(tmp_path_factory.mktemp("gpt2"), transformers.GPT2LMHeadModel(config))


def fine_tuned(recipes, base, model="GPT2", **options) -> tk.Trainer:
    """The guide's model loaded from the base folder and fine-tuned 2 epochs under FSDP on 8 devices."""
    trainer = tk.Trainer(recipes[model](), loss="sparse_categorical_crossentropy", optimizer=optax.adamw(1e-2),
                         strategy=tk.FSDP(min_shard_size=1), **options)  # fmt: skip
    trainer.init(TOKENS[:8, :-1])
    if model == "GPT2":
        tk.weights.load(base, into=trainer, layout="torch", rename=recipes["names_in"], as_is=recipes["conv1d_weights"])
    else:
        tk.weights.load(base, into=trainer, layout="torch", rename=recipes["llama_in"])
    trainer.fit(TOKENS[:, :-1], TOKENS[:, 1:], batch_size=8, epochs=2, verbose=0)
    return trainer


def logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def greedy(trainer: tk.Trainer, prompt: np.ndarray, steps: int) -> list[int]:
    """trainkit's greedy decode: the whole (causal) window each step, padded to a fixed length."""
    tokens = list(prompt)
    for _ in range(steps):
        window = np.zeros((8, 32), np.int32)
        window[:, : len(tokens)] = tokens
        tokens.append(int(np.argmax(trainer.predict(window, verbose=0)[0, len(tokens) - 1])))
    return tokens[len(prompt) :]


@pytest.fixture(scope="module")
def tuned(recipes, base, tmp_path_factory):
    gpt2 = fine_tuned(recipes, base)
    folder = tmp_path_factory.mktemp("out") / "gpt2-tuned"
    gpt2.save_pretrained(folder, config=base, tokenizer=base, rename=recipes["names_out"])
    return gpt2, folder


def test_a_fine_tuned_gpt2_folder_gives_trainkits_logits_and_greedy_tokens(tuned, base):
    gpt2, folder = tuned
    assert_read_as_trained(gpt2, folder, base, "GPT2LMHeadModel", "gpt2")


def test_a_fine_tuned_llama_folder_gives_trainkits_logits_and_greedy_tokens(recipes, tmp_path):
    torch.manual_seed(0)
    sizes = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4)
    config = transformers.LlamaConfig(**sizes, num_key_value_heads=2, tie_word_embeddings=False, eos_token_id=None)
    base = published(tmp_path / "llama", transformers.LlamaForCausalLM(config))
    llama = fine_tuned(recipes, base, model="Llama")
    llama.save_pretrained(tmp_path / "tuned", config=base, tokenizer=base, layout="torch", rename=recipes["llama_out"])
    assert_read_as_trained(llama, tmp_path / "tuned", base, "LlamaForCausalLM", "llama")


def assert_read_as_trained(trainer: tk.Trainer, folder: pathlib.Path, base: pathlib.Path, architecture, kind):
    """``from_pretrained(folder)`` gives the trainer's logits (which moved from the base's) and its greedy
    tokens; the folder holds the tokenizer, and a config that names the architecture and dtype."""
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["model_type"] == kind
    assert config["dtype"] == "float32" and "torch_dtype" not in config
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors"} <= set(
        os.listdir(folder)
    )
    read = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    before = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    ours = trainer.predict(TOKENS[:8, :-1], verbose=0)
    assert np.abs(ours - logits(before, TOKENS[:8, :-1])).max() > 1e-3  # it trained
    np.testing.assert_allclose(ours, logits(read, TOKENS[:8, :-1]), atol=1e-5)
    prompt = TOKENS[0, :8]
    with torch.no_grad():
        generated = read.generate(torch.from_numpy(prompt[None].astype(np.int64)), do_sample=False, max_new_tokens=20)
    assert generated[0, 8:].tolist() == greedy(trainer, prompt, 20)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer("t3 t5")["input_ids"] == [3, 5]


def test_shards_with_their_index_are_read_by_from_pretrained_and_by_tk_weights_load(tuned, base, recipes, tmp_path):
    gpt2, folder = tuned
    sharded = tmp_path / "sharded"
    gpt2.save_pretrained(sharded, config=base, rename=recipes["names_out"], max_shard_size="8KB")
    shards = sorted(name for name in os.listdir(sharded) if name.endswith(".safetensors"))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    from safetensors.numpy import load_file

    whole = load_file(folder / "model.safetensors")
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in whole.values())
    read = transformers.AutoModelForCausalLM.from_pretrained(sharded).eval()
    np.testing.assert_allclose(gpt2.predict(TOKENS[:8, :-1], verbose=0), logits(read, TOKENS[:8, :-1]), atol=1e-5)
    fresh = tk.Trainer(recipes["GPT2"](), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1))
    fresh.init(TOKENS[:8, :-1])
    report = tk.weights.load(sharded, into=fresh, layout="torch", rename=recipes["names_in"],
                             as_is=recipes["conv1d_weights"])  # fmt: skip
    assert len(report.loaded) == 28
    for ours, theirs in zip(jax.tree.leaves(fresh.get_weights()), jax.tree.leaves(gpt2.get_weights()), strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_bfloat16_is_written_as_bfloat16_and_the_config_object_says_so(tuned, base, recipes, tmp_path):
    gpt2, _ = tuned
    config = transformers.AutoConfig.from_pretrained(base)  # a transformers config object, as config= takes too
    gpt2.save_pretrained(tmp_path / "bf16", config=config, rename=recipes["names_out"], dtype="bfloat16")
    header = (tmp_path / "bf16" / "model.safetensors").read_bytes()
    described = json.loads(header[8 : 8 + int.from_bytes(header[:8], "little")])
    assert described["__metadata__"]["format"] == "pt"
    assert {entry["dtype"] for name, entry in described.items() if name != "__metadata__"} == {"BF16"}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    read = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert read.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"vocab_size": 80},
            r"transformer\.wte\.weight: written \(64, 16\), the architecture expects \(80, 16\) "
            r"\(the config's vocab_size is 80",
        ),  # fmt: skip
        ({"n_layer": 3}, r"missing \(the architecture has it, the weights do not\): transformer\.h\.2\.ln_1\.weight"),
        ({"rename": [(r"attn\.c_attn", "attn.qkv")]}, r"unexpected \(.*\): .*transformer\.h\.0\.attn\.qkv\.weight"),
        ({"architectures": None}, r"The config has no architectures"),
        ({"model_type": None}, r"The config has no model_type"),
    ],
)
def test_what_the_architecture_would_not_read_is_refused_before_anything_is_written(
    tuned, base, recipes, tmp_path, change, message
):
    gpt2, _ = tuned
    config = json.loads((base / "config.json").read_text())
    rename = recipes["names_out"] + change.pop("rename", [])
    config.update(change)
    with pytest.raises(ValueError, match=message):
        gpt2.save_pretrained(tmp_path / "refused", config=config, rename=rename)
    assert not os.path.exists(tmp_path / "refused") and os.listdir(tmp_path) == []


def test_a_write_that_fails_midway_leaves_the_old_folder_as_it_was(tuned, base, recipes, tmp_path, monkeypatch):
    gpt2, _ = tuned
    folder = tmp_path / "gpt2"
    gpt2.save_pretrained(folder, config=base, rename=recipes["names_out"])
    before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
    import safetensors.numpy

    written = []

    def full_disk(arrays, path, metadata=None):
        if written:
            raise OSError(28, "No space left on device")
        written.append(path)
        return original(arrays, path, metadata=metadata)

    original = safetensors.numpy.save_file
    monkeypatch.setattr(safetensors.numpy, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        gpt2.save_pretrained(folder, config=base, rename=recipes["names_out"], max_shard_size="8KB")
    assert written and {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before
    assert os.listdir(tmp_path) == ["gpt2"]  # no staging folder left


def test_the_base_folder_itself_is_not_written_over(tuned, base, recipes):
    gpt2, _ = tuned
    before = {name: (base / name).read_bytes() for name in os.listdir(base)}
    with pytest.raises(ValueError, match=r"which is what config= reads .*the published base there would be replaced"):
        gpt2.save_pretrained(base, config=base, rename=recipes["names_out"])
    assert {name: (base / name).read_bytes() for name in os.listdir(base)} == before


def test_a_folder_holding_other_files_is_not_replaced(tuned, base, recipes, tmp_path):
    gpt2, _ = tuned
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt"):
        gpt2.save_pretrained(tmp_path, config=base, rename=recipes["names_out"])
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_lora_adapters_are_a_peft_folder_with_trainkits_logits_and_so_is_the_merged_model(recipes, base, tmp_path):
    peft = pytest.importorskip("peft")
    gpt2 = fine_tuned(recipes, base, lora=tk.LoRA(rank=2, alpha=4, targets="attn"))
    gpt2.save_pretrained(tmp_path / "adapter", config=base, rename=recipes["names_out"], adapter=True)
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert settings["peft_type"] == "LORA" and settings["r"] == 2 and settings["lora_alpha"] == 4
    assert (
        settings["base_model_name_or_path"] == str(base) and "transformer.h.0.attn.c_attn" in settings["target_modules"]
    )
    base_model = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    ours, before = gpt2.predict(TOKENS[:8, :-1], verbose=0), logits(base_model, TOKENS[:8, :-1])
    assert np.abs(ours - before).max() > 1e-3  # the adapters trained
    adapted = peft.PeftModel.from_pretrained(base_model, tmp_path / "adapter").eval()  # adapts base_model in place
    np.testing.assert_allclose(ours, logits(adapted, TOKENS[:8, :-1]), atol=1e-5)
    gpt2.save_pretrained(tmp_path / "merged", config=base, rename=recipes["names_out"])
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(ours, logits(merged, TOKENS[:8, :-1]), atol=1e-5)


def test_adapters_of_a_base_never_loaded_or_of_another_width_are_refused(recipes, base, tmp_path):
    lora = tk.LoRA(rank=2, alpha=4, targets="attn")
    fresh = tk.Trainer(recipes["GPT2"](), loss="sparse_categorical_crossentropy", optimizer=optax.adamw(1e-2),
                       strategy="single", lora=lora)  # fmt: skip
    fresh.fit(TOKENS[:, :-1], TOKENS[:, 1:], batch_size=8, epochs=1, verbose=0)  # on a random base
    with pytest.raises(ValueError, match=r"this trainer's base was never loaded.*tk.weights.load\(base, into=trainer"):
        fresh.save_pretrained(tmp_path / "a", config=base, rename=recipes["names_out"], adapter=True)
    tuned = fine_tuned(recipes, base, lora=lora)
    wider = {**json.loads((base / "config.json").read_text()), "n_embd": 32}
    with pytest.raises(ValueError, match=r"The adapters of transformer.h.0.attn.c_attn map 16 inputs .* maps 32"):
        tuned.save_pretrained(tmp_path / "b", config=wider, rename=recipes["names_out"], adapter=True)
    elsewhere = published(tmp_path / "other", transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=16, n_layer=2, n_head=2, n_positions=32, vocab_size=64)))  # fmt: skip
    with pytest.raises(ValueError, match=r"trained on the base loaded from .* but config= names"):
        tuned.save_pretrained(tmp_path / "c", config=elsewhere, rename=recipes["names_out"], adapter=True)
    assert not any((tmp_path / name).exists() for name in "abc")


KILLED_WRITER = """
import os, re, signal, sys, pathlib
sys.path.insert(0, {tests!r})
import conftest  # 8 fake devices; the guide run as the tests run it
import optax, safetensors.numpy
import trainkit as tk

namespace = conftest.run_guide(pathlib.Path({guide!r}), first=3)
gpt2 = tk.Trainer(namespace["GPT2"](), loss="mse", optimizer=optax.sgd(0.1), strategy="single")
gpt2.init(namespace["tokens"][:, :-1])
tk.weights.load({tuned!r}, into=gpt2, layout="torch", rename=namespace["names_in"], as_is=namespace["conv1d_weights"])
original = safetensors.numpy.save_file
written = []


def killed_on_the_second_shard(arrays, path, metadata=None):
    if written:
        os.kill(os.getpid(), signal.SIGKILL)
    written.append(path)
    original(arrays, path, metadata=metadata)


safetensors.numpy.save_file = killed_on_the_second_shard
gpt2.save_pretrained({target!r}, config={base!r}, rename=namespace["names_out"], max_shard_size="8KB")
"""


def test_a_write_killed_midway_leaves_the_old_folder_and_the_next_write_clears_its_staging(
    tuned, base, recipes, tmp_path
):
    gpt2, folder = tuned
    target = tmp_path / "gpt2"
    gpt2.save_pretrained(target, config=base, rename=recipes["names_out"])
    before = {name: (target / name).read_bytes() for name in os.listdir(target)}
    script = KILLED_WRITER.format(tests=str(pathlib.Path(__file__).parent), guide=str(GUIDE), tuned=str(folder),
                                  target=str(target), base=str(base))  # fmt: skip
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert {name: (target / name).read_bytes() for name in os.listdir(target)} == before
    left = [name for name in os.listdir(tmp_path) if name != "gpt2"]
    assert len(left) == 1 and left[0].startswith(".gpt2.writing-")  # the killed write's staging, holding a shard
    gpt2.save_pretrained(target, config=base, rename=recipes["names_out"], max_shard_size="8KB")
    assert os.listdir(tmp_path) == ["gpt2"] and "model.safetensors.index.json" in os.listdir(target)
