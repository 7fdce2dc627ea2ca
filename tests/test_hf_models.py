"""docs/finetuning.md's Hugging Face recipes on real `transformers` models (where installed): a
GPT-2 written by ``save_pretrained`` loads into the recipe's Flax GPT-2 with PyTorch's logits,
trains, and goes back to ``GPT2LMHeadModel.from_pretrained`` with the trainer's logits; the
Llama recipe's names and shapes are those a real ``LlamaForCausalLM`` writes, and its logits PyTorch's."""

import pathlib
import shutil

import numpy as np
import optax
import pytest
from conftest import run_guide

import trainkit as tk

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

GUIDE = pathlib.Path(__file__).parent.parent / "docs" / "finetuning.md"


@pytest.fixture(scope="module")
def recipes() -> dict:
    """The guide's first three blocks run as written (the imports, the GPT-2 and Llama recipes)."""
    namespace = run_guide(GUIDE, first=3)
    assert {"GPT2", "names_in", "names_out", "conv1d_weights", "Llama", "llama_in", "llama_out"} <= namespace.keys()
    return namespace


def _logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


def test_a_saved_gpt2_loads_with_pytorchs_logits_and_goes_back_to_from_pretrained(recipes, tmp_path):
    config = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, n_positions=32, vocab_size=64)
    torch.manual_seed(0)
    published = transformers.GPT2LMHeadModel(config).eval()
    published.save_pretrained(tmp_path / "gpt2")
    tokens = np.random.default_rng(1).integers(0, 64, size=(8, 33)).astype(np.int32)

    gpt2 = tk.Trainer(
        recipes["GPT2"](),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.adamw(1e-3),
        strategy=tk.FSDP(min_shard_size=1),
    )
    gpt2.init(tokens[:, :-1])
    report = tk.weights.load(
        tmp_path / "gpt2" / "model.safetensors",
        into=gpt2,
        layout="torch",
        rename=recipes["names_in"],
        as_is=recipes["conv1d_weights"],
    )
    assert len(report.loaded) == 28 and not report.unexpected and not report.transposed_square
    np.testing.assert_allclose(gpt2.predict(tokens[:, :-1], verbose=0), _logits(published, tokens[:, :-1]), atol=1e-5)

    gpt2.fit(tokens[:, :-1], tokens[:, 1:], batch_size=8, epochs=2, verbose=0)
    (tmp_path / "tuned").mkdir()
    gpt2.save_weights(tmp_path / "tuned" / "model.safetensors", rename=recipes["names_out"])
    shutil.copy(tmp_path / "gpt2" / "config.json", tmp_path / "tuned")
    tuned = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "tuned").eval()
    ours = gpt2.predict(tokens[:, :-1], verbose=0)
    assert np.abs(ours - _logits(published, tokens[:, :-1])).max() > 1e-3  # it trained
    np.testing.assert_allclose(ours, _logits(tuned, tokens[:, :-1]), atol=1e-5)


LLAMA = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip


def test_the_llama_recipe_is_a_real_llama_its_names_shapes_and_logits(recipes, tmp_path):
    torch.manual_seed(0)
    published = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    published.save_pretrained(tmp_path / "llama")
    from safetensors.numpy import load_file

    stored = load_file(tmp_path / "llama" / "model.safetensors")
    assert {name: a.shape for name, a in stored.items()} == {
        name: a.shape for name, a in recipes["published_llama"]().items()
    }
    llama = tk.Trainer(recipes["Llama"](), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3))
    tokens = np.random.default_rng(2).integers(0, 64, size=(8, 24)).astype(np.int32)
    llama.init(tokens)
    report = tk.weights.load(tmp_path / "llama", into=llama, layout="torch", rename=recipes["llama_in"])
    assert len(report.loaded) == 21 and not report.unexpected
    np.testing.assert_allclose(llama.predict(tokens, verbose=0), _logits(published, tokens), atol=1e-5)
