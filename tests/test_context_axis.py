"""The context axis (#62, its first part): ``Hybrid(data=2, context=4)`` splits each row's sequence
over four devices inside the step, so every activation along it is split too and the compiler gathers
what attention needs; a causal transformer LM trains to SingleDevice's numbers, and one sequence
costs a device a fraction of what a data-sharded strategy can hold it in."""

import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import attention_written_out, check_resumes_and_loads_elsewhere, check_trains_like_single_device

import trainkit as tk
from trainkit.attn import active_split
from trainkit.planning.plan import short_name

SEQUENCE, WIDTH, VOCAB, HEADS = 512, 64, 64, 4


class Block(nn.Module):
    """``attention``: Flax's ``nn.dot_product_attention`` (reached and split by hand over a context
    axis), ``"tk"`` (tk.attention) or ``"written out"`` (left to the compiler)."""

    attention: str = "flax"

    @nn.compact
    def __call__(self, x):
        b, t, w = x.shape
        q, k, v = (a.reshape(b, t, HEADS, w // HEADS) for a in jnp.split(nn.Dense(3 * w)(nn.LayerNorm()(x)), 3, -1))
        if self.attention == "tk":
            attended = tk.attention(q, k, v, causal=True)
        elif self.attention == "written out":
            attended = attention_written_out(q, k, v)
        else:
            attended = nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(jnp.ones((b, t))))
        x = x + nn.Dense(w)(attended.reshape(b, t, w))
        return x + nn.Dense(w)(nn.gelu(nn.Dense(4 * w)(nn.LayerNorm()(x))))


class CausalLM(nn.Module):  # 2 layers, width 64, sequence 512
    attention: str = "flax"

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH)(tokens) + nn.Embed(SEQUENCE, WIDTH)(jnp.arange(tokens.shape[1]))
        for _ in range(2):
            x = Block(self.attention)(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def data(rows, sequence=SEQUENCE):
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(rows, sequence + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def lm(strategy, model=None):
    """SGD: Adam would turn the key bias's gradient, zero but for rounding (softmax ignores a shift shared by
    every key), into full-size steps whose signs follow the rounding, which differs with the devices."""
    return tk.Trainer(
        model or CausalLM(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy=strategy
    )


def test_a_causal_lm_on_a_context_axis_trains_to_single_devices_numbers():
    """20 steps of 2 rows, the last batch padded (39 rows)."""
    x, y = data(39)
    check_trains_like_single_device(lm, tk.Hybrid(data=2, context=4), x, y, batch_size=2, steps=20)


def test_one_sequence_costs_a_device_a_fraction_of_the_least_a_data_sharded_strategy_holds():
    """Compiled, not run: the temporaries per device at one sequence per data group (a batch of 2)
    under Hybrid(data=2, context=4), against Hybrid(data=2, fsdp=4) at one sequence per device."""
    x, y = data(8)
    context = lm("single").plan((x[:2], y[:2]), batch_size=2, candidates=[tk.Hybrid(data=2, context=4)], verbose=0)
    fsdp = lm("single").plan((x, y), batch_size=8, candidates=[tk.Hybrid(data=2, fsdp=4)], verbose=0)
    (split,), (sharded,) = context.rows, fsdp.rows
    assert split.error is None and sharded.error is None
    assert split.temp_bytes <= 0.4 * sharded.temp_bytes, (split.temp_bytes, sharded.temp_bytes)


def test_hybrid_refuses_a_sequence_axis_that_is_not_one():
    with pytest.raises(ValueError, match="sequence_axis must be a positive integer"):
        tk.Hybrid(data=2, context=4, sequence_axis=0)


def test_a_context_run_resumes_bit_exact_and_its_checkpoint_loads_onto_single_device_and_fsdp(tmp_path):
    x, y = data(8, sequence=64)
    check_resumes_and_loads_elsewhere(lm, lambda: tk.Hybrid(data=2, context=4), x, y, 2, tmp_path / "checkpoint")


def test_auto_weighs_a_context_axis_when_the_batch_has_fewer_sequences_than_devices():
    """Two sequences on eight devices: no data-sharded strategy splits them; a context axis does, and "auto"
    picks it when one device cannot hold a sequence (a memory limit between the two)."""
    x, y = data(2)
    plan = lm("single").plan((x, y), batch_size=2, verbose=0)
    rows = {row.name: row for row in plan.rows}
    context, single = rows["Hybrid(data=2, context=4)"], rows["SingleDevice"]
    assert context.error is None and single.error is None, (context.error, single.error)
    assert context.total_bytes < single.total_bytes
    limit = int((context.total_bytes + single.total_bytes) / 2 / 0.9)
    auto = lm(tk.strategies.Auto(memory_limit=limit, measure=False))
    auto.fit(x, y, batch_size=2, epochs=1, verbose=0)
    assert short_name(auto.strategy) == "Hybrid(data=2, context=4)", auto.strategy


def test_tk_attention_splits_over_the_context_axis_by_hand_and_trains_to_single_devices_numbers():
    """Each device keeps its queries' chunk and all-gathers keys and values (the causal mask from global
    positions): the same numbers as one device, where tk.attention is jax.nn.dot_product_attention."""
    x, y = data(7)
    check_trains_like_single_device(
        lambda strategy: lm(strategy, CausalLM("tk")), tk.Hybrid(data=2, context=4), x, y, batch_size=2, steps=4
    )
    plan = lm("single", CausalLM("tk")).plan((x[:2], y[:2]), batch_size=2, candidates=[tk.Hybrid(data=2, context=4)])
    (row,) = plan.rows
    text = row.compiled.as_text()
    gathers = [line for line in text.splitlines() if "all-gather(" in line and "f32[1,512,4,16]" in line.split("=")[1]]
    assert gathers, "keys and values gathered whole over the context axis"
    notes = " ".join(row.layout_notes())
    assert "2 attention call(s) split by hand (tk.attention" in notes
    assert "2 causal one(s) balanced (9 of 16 score tiles per device)" in notes


def test_the_plan_says_when_the_context_axis_did_not_split_a_models_attention():
    """Attention written out as einsums trains right (the compiler gathers what it needs), and the plan
    says trainkit did not split it; so does Flax's nn.dot_product_attention by default, which
    ``reach_attention=True`` reaches unedited and splits."""
    x, y = data(2)
    cases = [("written out", tk.Hybrid(data=2, context=4)), ("flax", tk.Hybrid(data=2, context=4))]
    cases.append(("flax", tk.Hybrid(data=2, context=4, reach_attention=True)))
    rows = [
        lm("single", CausalLM(attention)).plan((x, y), batch_size=2, candidates=[strategy]).rows[0]
        for attention, strategy in cases
    ]
    written_out_row, flax_row, reached_row = rows
    for row in (written_out_row, flax_row):
        assert row.error is None and row.attention == []
        assert "did not split the model's attention" in row.layout_notes()[0]
        assert "reach_attention=True" in row.layout_notes()[0]
    assert [(c.door, c.split) for c in reached_row.attention] == [("nn.dot_product_attention", True)] * 2
    assert "2 attention call(s) split by hand (nn.dot_product_attention" in reached_row.layout_notes()[0]


class Raising(nn.Module):
    """Calls JAX's and Flax's attention, then fails while the step is traced under the context axis
    (its first calls, checking the outputs on the host, pass)."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH)(tokens).reshape(*tokens.shape, HEADS, WIDTH // HEADS)
        x = jax.nn.dot_product_attention(x, x, x, is_causal=True) + nn.dot_product_attention(x, x, x)
        if active_split() is not None:
            raise RuntimeError("the model fails mid-trace")
        return nn.Dense(VOCAB)(x.reshape(*tokens.shape, WIDTH))


def test_the_reached_names_are_put_back_when_the_trace_raises():
    originals = (jax.nn.dot_product_attention, nn.dot_product_attention, nn.attention.dot_product_attention)
    x, y = data(8, sequence=64)
    trainer = lm(tk.Hybrid(data=2, context=4, reach_attention=True), Raising())
    with pytest.raises(RuntimeError, match="the model fails mid-trace"):
        trainer.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert (jax.nn.dot_product_attention, nn.dot_product_attention, nn.attention.dot_product_attention) == originals


def test_the_lm_examples_jax_attention_gives_its_written_out_numbers_and_is_split_balanced():
    """examples/lm.py's ``ByteLM(jax_attention=True)`` (the capacity benchmark's context row): the same
    parameters and logits as its attention written out, and under a context axis each block's attention
    is split by hand, its causal tiles balanced."""
    sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))
    from lm import ByteLM

    tokens = np.random.default_rng(0).integers(0, 256, size=(2, 64)).astype(np.int32)
    small = dict(layers=2, d_model=32, heads=4, mlp=64, max_len=64)
    written, by_jax = ByteLM(**small), ByteLM(**small, jax_attention=True)
    variables = written.init(jax.random.key(0), tokens)
    assert jax.tree.structure(by_jax.init(jax.random.key(0), tokens)) == jax.tree.structure(variables)
    np.testing.assert_allclose(by_jax.apply(variables, tokens), written.apply(variables, tokens), atol=1e-5)
    trainer = tk.Trainer(by_jax, loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1))
    (row,) = trainer.plan((tokens, tokens), batch_size=2, candidates=[tk.Hybrid(data=2, context=4)], verbose=0).rows
    assert [(c.door, c.split, c.balanced) for c in row.attention] == [("tk.attention", True, True)] * 2
