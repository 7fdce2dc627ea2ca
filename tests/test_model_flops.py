"""The model's own flops (#80 item 5), which MFU divides by: its matrix multiplies as the shapes
say, three times the forward's, the same under every strategy and with remat, causal attention
halved whichever implementation runs it, a scanned layer counted per step, a convolution per window."""

import io
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_classification

import trainkit as tk
from trainkit.core import chips, cost


@pytest.mark.parametrize("strategy", ["single", "data_parallel", "fsdp"])
def test_a_step_counts_the_model_the_same_under_every_strategy(strategy):
    x, y = make_classification(64)
    trainer = tk.Trainer(_Two(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy=strategy)
    trainer.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert tk.debug.model_step_flops(trainer) == 3 * 2 * 32 * (5 * 16 + 16 * 3)


class _Two(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(16)(x)))


@pytest.mark.parametrize("implementation", ["xla", "pallas-interpret"])
def test_causal_attention_counts_half_its_scores_whichever_implementation_runs_it(implementation):
    q = jnp.ones((2, 256, 2, 64))
    scores = 2 * 2 * (2 * 2 * 256 * 256 * 64)  # q.k and p.v: two flops per multiply-add, per (batch, head)

    def flops(causal):
        return cost.model_flops(lambda q: tk.attention(q, q, q, causal=causal, implementation=implementation), q)

    assert flops(False) == 3 * scores
    assert flops(True) == 3 * scores / 2


class _Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        layer = nn.scan(_Residual, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)
        return layer()(x, None)[0]


class _Residual(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(8)(x), None


def test_a_scanned_layer_counts_once_per_step_of_its_scan_and_a_convolution_per_window():
    x = jnp.ones((16, 8))
    params = _Scanned().init(jax.random.key(0), x)
    assert cost.model_flops(lambda p: _Scanned().apply(p, x), params) == 3 * 4 * (2 * 16 * 8 * 8)
    conv = nn.Conv(6, (3, 3), padding="VALID", use_bias=False)
    image = jnp.ones((2, 10, 10, 4))
    weights = conv.init(jax.random.key(0), image)
    per_window = 3 * 3 * 4  # a kernel window's inputs
    assert cost.model_flops(lambda p: conv.apply(p, image), weights) == 3 * 2 * (2 * 8 * 8 * 6) * per_window
    xla = jax.jit(lambda p: conv.apply(p, image)).lower(weights).cost_analysis()["flops"]  # the compiler agrees
    assert cost.model_flops(lambda p: conv.apply(p, image), weights) == pytest.approx(3 * xla, rel=0.05)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(32)(nn.relu(nn.Dense(128)(x)))


class _Blocks(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = _Block()(x)
        return nn.Dense(3)(x)


def test_the_progress_bar_shows_mfu_beside_hfu_and_remat_raises_only_hfu(monkeypatch):
    from rich.console import Console

    from trainkit.monitoring import utilisation

    x, y = make_classification(64, features=32)
    monkeypatch.setattr(chips, "CHIPS", (chips.Chip("a CPU", ("cpu",), 1e9, 1e9),))  # as if it had a data sheet
    shares = {}
    for remat in (None, ["_Block"]):
        out = io.StringIO()
        bar = tk.callbacks.ProgressBar(verbose=1, console=Console(file=out, force_terminal=True, width=200))
        trainer = tk.Trainer(
            _Blocks(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single", remat=remat
        )
        trainer.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[bar])
        shown = re.findall(r"MFU (\d+\.\d)% at the median step \(HFU (\d+\.\d)%\)", out.getvalue())
        assert len(shown) == 1 and float(shown[0][0]) > 0, out.getvalue()
        assert not remat or float(shown[0][0]) < float(shown[0][1]), out.getvalue()  # remat: HFU above MFU
        shares[bool(remat)] = utilisation.per_step(trainer, np.float32)
    assert shares[True].model == shares[False].model  # remat does not inflate MFU ...
    assert shares[True].hardware > 1.1 * shares[False].hardware  # ... only the compiler's count


def test_the_lm_example_counts_as_maxtext_does_6n_per_token_and_causal_attention_halved():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from lm import ByteLM

    length, width, layers, batch = 256, 128, 2, 4
    model = ByteLM(layers=layers, d_model=width, heads=2, mlp=4 * width, max_len=length, jax_attention=True)
    tokens = jnp.zeros((batch, length), jnp.int32)
    params = model.init(jax.random.key(0), tokens)
    weights = layers * (4 * width * width + 2 * width * 4 * width) + width * 256  # q, k, v, out, the MLP; logits
    attention = layers * 3 * (4 * batch * length * length * width) / 2  # q.k and p.v, causal: half
    assert cost.model_flops(lambda p: model.apply(p, tokens), params) == 6 * weights * batch * length + attention
