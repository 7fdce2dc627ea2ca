"""The invariant: every strategy gives SingleDevice's parameters and a hand-written optax loop's,
across a ragged last batch; evaluate and predict are exact for any device count."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, make_classification, strategy_table, tree_allclose
from jax.sharding import PartitionSpec as P

import trainkit as tk

MLP_TENSOR_RULES = [(r"Dense_0/kernel", P(None, "model")), (r"Dense_1/kernel", P("model", None))]

# min_shard_size=16: the tiny MLP's leaves are really sharded
STRATEGIES = strategy_table(min_shard_size=16, dp4=True, model_rules=MLP_TENSOR_RULES)
SHARDED = ["dp8", "dp4", "fsdp8", "hybrid2x4_fsdp", "hybrid2x4_model"]


def hand_written(x, y, batch_size, epochs, lr, seed):
    """A plain optax loop over the same (unshuffled) batches, the last one smaller."""
    model = MLP()
    init_rng, _ = jax.random.split(jax.random.PRNGKey(seed))
    params_rng, dropout_rng = jax.random.split(init_rng)  # as trainkit's linen adapter does
    params = model.init({"params": params_rng, "dropout": dropout_rng}, x[:1])["params"]
    tx = optax.sgd(lr, momentum=0.9)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, xb, yb):
        def loss(p):
            logits = model.apply({"params": p}, xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        grads = jax.grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for _ in range(epochs):
        for lo in range(0, len(x), batch_size):
            params, opt_state = step(params, opt_state, x[lo : lo + batch_size], y[lo : lo + batch_size])
    return params


@pytest.fixture(scope="module")
def trained(data):
    x, y = data
    results = {}
    for name, make in STRATEGIES.items():
        trainer = tk.Trainer(
            MLP(),
            loss=optax.softmax_cross_entropy_with_integer_labels,
            optimizer=optax.sgd(0.1, momentum=0.9),
            metrics=["accuracy"],
            strategy=make(),
            seed=3,
        )
        history = trainer.fit((x, y), epochs=2, batch_size=16, shuffle=False, verbose=0)
        results[name] = (trainer, history)
    return results


@pytest.mark.parametrize("name", SHARDED)
def test_strategies_match_single_device(trained, name):
    tree_allclose(trained[name][0].params, trained["single"][0].params)
    np.testing.assert_allclose(trained[name][1].history["loss"], trained["single"][1].history["loss"], rtol=1e-5)


def test_single_device_matches_hand_written_loop(trained, data):
    x, y = data
    expected = hand_written(x, y, batch_size=16, epochs=2, lr=0.1, seed=3)
    tree_allclose(trained["single"][0].params, expected)
    tree_allclose(trained["dp8"][0].params, expected)
    assert int(trained["dp8"][0].state.step) == 2 * 7  # ceil(100 / 16) steps per epoch


def test_sharded_state_really_is_sharded(trained):
    params = trained["fsdp8"][0].state.params
    assert params["Dense_0"]["kernel"].sharding.spec == P(None, "fsdp")
    opt_state = trained["fsdp8"][0].state.opt_state  # momentum follows its parameter
    assert jax.tree.leaves(opt_state)[1].sharding.spec == params["Dense_0"]["kernel"].sharding.spec
    tensor = trained["hybrid2x4_model"][0].state.params["Dense_1"]["kernel"]
    assert tensor.sharding.spec == P("model", None)
    assert tensor.addressable_shards[0].data.shape == (4, 3)


@pytest.mark.parametrize("name", SHARDED)
@pytest.mark.parametrize("n", [1, 37, 100])
def test_evaluate_and_predict_exact_on_every_strategy(trained, name, n):
    x, y = make_classification(n, seed=n)
    single, other = trained["single"][0], trained[name][0]
    other.set_weights(single.get_weights())  # the same parameters on both
    e1, e8 = (
        single.evaluate((x, y), batch_size=16, return_dict=True),
        other.evaluate((x, y), batch_size=16, return_dict=True),
    )
    assert e1.keys() == e8.keys() == {"loss", "accuracy"}
    for k in e1:
        assert e1[k] == pytest.approx(e8[k], rel=1e-6)
    logits = MLP().apply({"params": single.params}, x)
    expected_loss = float(optax.softmax_cross_entropy_with_integer_labels(logits, y).mean())
    assert e1["loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert e1["accuracy"] == pytest.approx(float(np.mean(np.argmax(logits, -1) == y)))
    p1, p8 = single.predict(x, batch_size=16), other.predict(x, batch_size=24)
    assert p1.shape == p8.shape == (n, 3)
    np.testing.assert_allclose(p1, logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(p8, logits, rtol=1e-5, atol=1e-6)


def test_sample_weights_follow_keras_semantics():
    x, y = make_classification(24)
    w = np.linspace(0.0, 2.0, 24).astype(np.float32)
    results = []
    for strategy in (tk.SingleDevice(), tk.DataParallel()):
        trainer = tk.Trainer(
            MLP(),
            loss="sparse_categorical_crossentropy",
            optimizer=optax.sgd(0.1),
            metrics=["accuracy"],
            weighted_metrics=["accuracy"],
            strategy=strategy,
        )
        trainer.init(x)
        results.append(trainer.evaluate((x, y, w), batch_size=16, return_dict=True))
    params = tk.Trainer(MLP(), loss="mse", optimizer=optax.sgd(0.1), strategy="dp").init(x).params
    logits = MLP().apply({"params": jax.device_get(params)}, x)
    per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    correct = np.argmax(logits, -1) == y
    for result in results:
        # loss: sum(w * l) / rows (Keras "sum_over_batch_size"); metrics: unweighted means;
        # weighted_metrics: weighted means
        assert result["loss"] == pytest.approx(float(jnp.sum(w * per_example) / 24), rel=1e-5)
        assert result["accuracy"] == pytest.approx(float(np.mean(correct)), rel=1e-6)
        assert result["weighted_accuracy"] == pytest.approx(float(np.sum(w * correct) / np.sum(w)), rel=1e-6)


class Tagger(nn.Module):
    """Per-token outputs (B, T, C): a loss with more than one value per row."""

    @nn.compact
    def __call__(self, tokens):
        return nn.Dense(4)(nn.Embed(10, 8)(tokens))


def test_sequence_loss_and_scalar_loss_are_masked_exactly():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 10, size=(20, 6)).astype(np.int32)
    labels = (tokens % 4).astype(np.int32)

    def mean_loss(logits, labels):  # returns a scalar: trainkit evaluates it row by row
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    params = {}
    for name, loss in (("per_token", optax.softmax_cross_entropy_with_integer_labels), ("scalar", mean_loss)):
        for strategy in ("single", tk.DataParallel()):
            trainer = tk.Trainer(Tagger(), loss=loss, optimizer=optax.adam(0.05), strategy=strategy)
            trainer.fit((tokens, labels), batch_size=8, epochs=2, shuffle=False, verbose=0)
            params[name, str(strategy)[:6]] = trainer.params
    reference = params["per_token", "single"]
    for value in params.values():
        tree_allclose(value, reference, rtol=1e-4, atol=1e-5)
