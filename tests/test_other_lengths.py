"""#83 item 5 (part): ``predict`` and ``evaluate`` take sequences of another length than the one the model
was built with, as Keras retraces per shape (one compile per length), on every strategy; ``fit`` keeps its
length; a model that cannot take another length says so with the model's own error."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import trainkit as tk

VOCAB = 16
X = np.random.default_rng(0).integers(0, VOCAB, (64, 12)).astype(np.int32)


class TokenModel(nn.Module):
    """Per-token logits: any length."""

    @nn.compact
    def __call__(self, tokens):
        return nn.Dense(VOCAB)(nn.relu(nn.Dense(8)(nn.Embed(VOCAB, 8)(tokens))))


class Flattened(nn.Module):
    """Reads the whole row at once: one length only."""

    @nn.compact
    def __call__(self, tokens):
        return nn.Dense(2)(nn.Embed(VOCAB, 4)(tokens).reshape(tokens.shape[0], -1))


def trained(model, strategy, y=X):
    trainer = tk.Trainer(model, loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy=strategy)
    trainer.fit(X, y, batch_size=16, epochs=1, verbose=0)
    return trainer


@pytest.mark.parametrize("strategy", ["single", "data_parallel", "fsdp"])
def test_predict_and_evaluate_take_another_length(strategy):
    trainer = trained(TokenModel(), strategy)
    short = X[:, :7]
    expected = TokenModel().apply({"params": jax.device_get(trainer.params)}, short)
    np.testing.assert_allclose(trainer.predict(short, batch_size=16), expected, rtol=1e-5, atol=1e-6)
    loss = trainer.evaluate(short, short, batch_size=16)
    manual = -np.mean(np.take_along_axis(jax.nn.log_softmax(expected), short[..., None], -1))
    assert loss == pytest.approx(float(manual), rel=1e-5)
    assert trainer.predict(X[:, :12], batch_size=16).shape == (64, 12, VOCAB)  # the built length still runs


def test_fit_keeps_its_length_and_a_model_of_one_length_says_so():
    trainer = trained(TokenModel(), "single")
    with pytest.raises(ValueError, match=r"per-example shape \(7,\).*initialised with per-example shape \(12,\)"):
        trainer.fit(X[:, :7], X[:, :7], batch_size=16, epochs=1, verbose=0)
    fixed = trained(Flattened(), "single", y=(X[:, 0] > 7).astype(np.int32))
    with pytest.raises(
        ValueError, match=r"per-example shape \(7,\).*\(Tried, .*The model raised .* whose inputs are int32\[16, 7\]"
    ):
        fixed.predict(X[:, :7], batch_size=16)
