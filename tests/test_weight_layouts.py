"""Published layouts the torch layout cannot guess: Hugging Face's ``Conv1D`` (GPT-2) stores 2-D
weights as (in, out), as Flax does. The report quotes shapes as stored, names the square weights
``layout="torch"`` transposed, and ``as_is=`` loads the named entries untransposed;
``keep_initial`` that matches nothing is refused, as ``trainable=`` is."""

import flax.linen as nn
import numpy as np
import optax
import pytest
from safetensors.numpy import save_file

import trainkit as tk

WIDTH = 16


class Block(nn.Module):
    """GPT-2's block names: attn.c_attn (16 -> 48), attn.c_proj (16 -> 16: square), mlp.c_fc, mlp.c_proj."""

    @nn.compact
    def __call__(self, x):
        attn = nn.Dense(WIDTH, name="c_proj")(nn.Dense(3 * WIDTH, name="c_attn")(x)[..., :WIDTH])
        hidden = nn.Dense(4 * WIDTH, name="c_fc")(x + attn)
        return nn.Dense(WIDTH, name="c_proj_mlp")(nn.gelu(hidden))


def trainer():
    t = tk.Trainer(Block(), loss="mse", optimizer=optax.sgd(0.1), strategy="single")
    t.init(np.zeros((2, WIDTH), np.float32))
    return t


def hugging_face_file(path):
    """The block as Hugging Face's save_pretrained writes GPT-2: dotted names, Conv1D weights (in, out)."""
    rng = np.random.default_rng(0)
    shapes = {"attn.c_attn": (WIDTH, 3 * WIDTH), "attn.c_proj": (WIDTH, WIDTH), "mlp.c_fc": (WIDTH, 4 * WIDTH)}
    shapes["mlp.c_proj"] = (4 * WIDTH, WIDTH)
    tensors = {}
    for name, shape in shapes.items():
        tensors[f"h.0.{name}.weight"] = rng.normal(size=shape).astype(np.float32)
        tensors[f"h.0.{name}.bias"] = rng.normal(size=shape[1]).astype(np.float32)
    save_file(tensors, str(path))
    return tensors


RENAME = [(r"^h\.0\.attn\.", ""), (r"^h\.0\.mlp\.c_proj", "c_proj_mlp"), (r"^h\.0\.mlp\.", "")]
AS_IS = [r"\.c_(attn|proj|fc)\.weight$"]


def test_conv1d_weights_are_reported_as_stored_with_the_as_is_fix(tmp_path):
    hugging_face_file(tmp_path / "gpt2.safetensors")
    with pytest.raises(ValueError) as refused:
        tk.weights.load(tmp_path / "gpt2.safetensors", into=trainer(), layout="torch", rename=RENAME)
    text = str(refused.value)
    assert "c_attn/kernel: shape (16, 48) in the source (as stored), (16, 48) in the model" in text, text
    assert "as_is=" in text, text


def test_square_weights_the_layout_transposed_are_named(tmp_path):
    hugging_face_file(tmp_path / "gpt2.safetensors")
    report = tk.weights.load(tmp_path / "gpt2.safetensors", into=trainer(), layout="torch", rename=RENAME, strict=False)
    assert report.transposed_square == ("h.0.attn.c_proj.weight",), report
    assert "h.0.attn.c_proj.weight" in str(report) and "cannot confirm" in str(report)


def test_as_is_loads_conv1d_weights_untransposed(tmp_path):
    tensors = hugging_face_file(tmp_path / "gpt2.safetensors")
    loaded = trainer()
    report = tk.weights.load(tmp_path / "gpt2.safetensors", into=loaded, layout="torch", rename=RENAME, as_is=AS_IS)
    assert len(report.loaded) == 8 and not report.transposed_square, report
    params = loaded.get_weights()["params"]
    np.testing.assert_array_equal(params["c_proj"]["kernel"], tensors["h.0.attn.c_proj.weight"])  # square: as stored
    np.testing.assert_array_equal(params["c_attn"]["kernel"], tensors["h.0.attn.c_attn.weight"])
    np.testing.assert_array_equal(params["c_proj_mlp"]["kernel"], tensors["h.0.mlp.c_proj.weight"])


def test_keep_initial_and_as_is_that_match_nothing_or_are_not_regexes_are_refused(tmp_path):
    hugging_face_file(tmp_path / "gpt2.safetensors")
    with pytest.raises(ValueError, match=r"keep_initial='\^lm_head/' matches none of the model's variables"):
        tk.weights.load(
            tmp_path / "gpt2.safetensors", into=trainer(), layout="torch", rename=RENAME, as_is=AS_IS,
            keep_initial=["^lm_head/"],
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"as_is: '\(' is not a regular expression"):
        tk.weights.load(tmp_path / "gpt2.safetensors", into=trainer(), layout="torch", as_is=["("])


def test_save_weights_under_a_pickle_s_name_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"ends in '\.pt', which readers take for a pickle.*Name it \.safetensors"):
        trainer().save_weights(tmp_path / "model.pt")
    assert not list(tmp_path.iterdir())


def test_rename_pairs_that_write_two_variables_under_one_name_are_refused(tmp_path):
    """Two variables renamed alike would have left one of them in the file, silently."""
    with pytest.raises(ValueError, match=r"rename writes two variables as '.*w': make each pair's result distinct"):
        trainer().save_weights(tmp_path / "model.safetensors", rename=[(r"(kernel|bias)$", "w")])
    assert not list(tmp_path.iterdir())
