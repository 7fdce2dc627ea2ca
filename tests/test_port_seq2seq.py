"""docs/porting_from_keras.md's padded seq2seq Transformer (keras-io's English-to-Spanish recipe, shrunk):
the page's port run as written, then trained side by side with its Keras original (JAX backend) from Keras's
initial weights, SGD, no shuffling, 100 rows at batch 32 (a ragged last batch), with ``ignore_class=0`` and
with the padding mask as a per-token ``sample_weight``: the same losses and parameters within 1e-6 on
SingleDevice and DataParallel (issue #83)."""

import pathlib

import numpy as np
import optax
import pytest
from conftest import run_guide, tree_allclose

import trainkit as tk

keras = pytest.importorskip("keras")

PAGE = pathlib.Path(__file__).parent.parent / "docs" / "porting_from_keras.md"
FIT = {"batch_size": 32, "epochs": 2, "shuffle": False, "verbose": 0}


@pytest.fixture(scope="module")
def port() -> dict:
    """The page's seq2seq block, run as written (it trains the port once)."""
    return run_guide(PAGE, where="class Translator(")


class Positions(keras.layers.Layer):
    """A learned position embedding added to the tokens' (the port's ``<name>_positions`` parameter)."""

    def build(self, shape):
        self.positions = self.add_weight(shape[1:], initializer=keras.initializers.RandomUniform(-0.1, 0.1))

    def call(self, x):
        return x + self.positions


def keras_translator(vocab: int, length: int, width: int, heads: int):
    """The page's Keras original (its ```text block), built here."""
    layers = keras.layers
    source = keras.Input((length,), dtype="int32", name="source")
    target_in = keras.Input((length,), dtype="int32", name="target_in")
    source_mask = keras.ops.expand_dims(keras.ops.not_equal(source, 0), 1)
    target_mask = keras.ops.expand_dims(keras.ops.not_equal(target_in, 0), 1)

    def embed(tokens, name):
        return Positions(name=f"{name}_positions")(layers.Embedding(vocab, width, name=f"{name}_tokens")(tokens))

    def block(x, name, *attentions):
        for i, (memory, mask, causal) in enumerate(attentions):
            memory = x if memory is None else memory
            attended = layers.MultiHeadAttention(heads, width // heads, name=f"{name}_attention{i}")(
                x, memory, attention_mask=mask, use_causal_mask=causal
            )
            x = layers.LayerNormalization(name=f"{name}_norm{i}")(x + attended)
        hidden = layers.Dense(2 * width, activation="relu", name=f"{name}_hidden")(x)
        return layers.LayerNormalization(name=f"{name}_norm{len(attentions)}")(
            x + layers.Dense(width, name=f"{name}_out")(hidden)
        )

    memory = block(embed(source, "source"), "encoder", (None, source_mask, False))
    x = block(embed(target_in, "target"), "decoder", (None, target_mask, True), (memory, source_mask, False))
    return keras.Model({"source": source, "target_in": target_in}, layers.Dense(vocab, name="logits")(x))


def flax_params(model) -> dict:
    """A Keras model's weights as the port's parameters, layer by layer under the same names."""
    params: dict = {}
    for layer in model.layers:
        w = layer.get_weights()
        if isinstance(layer, keras.layers.Embedding):
            params[layer.name] = {"embedding": w[0]}
        elif isinstance(layer, Positions):
            params[layer.name] = w[0]
        elif isinstance(layer, keras.layers.Dense):
            params[layer.name] = {"kernel": w[0], "bias": w[1]}
        elif isinstance(layer, keras.layers.LayerNormalization):
            params[layer.name] = {"scale": w[0], "bias": w[1]}
        elif isinstance(layer, keras.layers.MultiHeadAttention):
            parts = ("query", "key", "value", "attention_output")
            params[layer.name] = {part: {"kernel": w[2 * i], "bias": w[2 * i + 1]} for i, part in enumerate(parts)}
    return params


@pytest.fixture(scope="module")
def keras_runs(port) -> dict:
    """Keras's initial weights, and what Keras trains from them with each way of masking the padding."""
    keras.utils.set_random_seed(0)
    model = keras_translator(*(port[name] for name in ("VOCAB", "LENGTH", "WIDTH", "HEADS")))
    initial = model.get_weights()
    x, y = port["x"], port["y"]
    runs = {"initial": flax_params(model)}
    for way, ignore_class, weights in (("ignore_class", 0, None), ("sample_weight", None, (y != 0).astype("float32"))):
        model.set_weights(initial)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=ignore_class)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        history = model.fit(x, y, sample_weight=weights, **FIT).history["loss"]
        runs[way] = (history, flax_params(model), model.evaluate(x, y, sample_weight=weights, verbose=0))
    return runs


@pytest.mark.parametrize("strategy", ["single", "dp"])
@pytest.mark.parametrize("way", ["ignore_class", "sample_weight"])
def test_the_padded_seq2seq_port_trains_as_keras(port, keras_runs, strategy, way):
    x, y = port["x"], port["y"]
    weights = (y != 0).astype("float32") if way == "sample_weight" else None
    trainer = tk.Trainer(
        port["Translator"](),
        loss=tk.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0 if weights is None else None),
        optimizer=optax.sgd(0.1),
        strategy=strategy,
        params=keras_runs["initial"],
    )
    history, params, evaluated = keras_runs[way]
    np.testing.assert_allclose(trainer.fit(x, y, sample_weight=weights, **FIT).history["loss"], history, rtol=1e-6)
    tree_allclose(trainer.params, params, rtol=0, atol=1e-6)
    np.testing.assert_allclose(trainer.evaluate(x, y, sample_weight=weights, verbose=0), evaluated, rtol=1e-6)


def test_the_two_ways_of_masking_padding_are_different_losses(keras_runs):
    """The page's warning: a 0/1 per-token weight divides by every token, ``ignore_class`` by the real ones."""
    by_ignoring, by_weighing = keras_runs["ignore_class"][0][0], keras_runs["sample_weight"][0][0]
    assert by_weighing < 0.9 * by_ignoring, (by_weighing, by_ignoring)
