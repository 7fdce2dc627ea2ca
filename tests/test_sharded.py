"""FSDP and Hybrid: the same results as SingleDevice on a model with Dense, Conv, Embed and
LayerNorm (and with BatchNorm and Dropout), a state that really is split, and clear errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import Wide, strategy_table, tree_allclose
from jax.sharding import PartitionSpec as P

import trainkit as tk

TENSOR_RULES = [
    (r"Conv_0/kernel", P(None, None, None, "model")),
    (r"Embed_0/embedding", P(None, "model")),
    (r"Dense_0/kernel", P(None, "model")),
    (r"Dense_1/kernel", P("model", None)),
]


class Mixed(nn.Module):
    """Conv + LayerNorm on an image, Embed on tokens, two Dense layers; optionally BatchNorm
    (with a named axis for DataParallel) and Dropout."""

    noisy: bool = False
    bn_axis: str | None = None

    @nn.compact
    def __call__(self, pixels, tokens, train: bool = False):
        image = nn.Conv(8, (3, 3))(pixels)
        image = nn.LayerNorm()(nn.relu(image)).mean(axis=(1, 2))
        words = nn.Embed(16, 8)(tokens).mean(axis=1)
        h = nn.relu(nn.Dense(16)(jnp.concatenate([image, words], axis=-1)))
        if self.noisy:
            h = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.bn_axis)(h)
            h = nn.Dropout(0.3, deterministic=not train)(h)
        return nn.Dense(4)(h)


def mixed_data(n=44, seed=0):
    rng = np.random.default_rng(seed)
    pixels = rng.normal(size=(n, 6, 6, 1)).astype(np.float32)
    tokens = rng.integers(0, 16, size=(n, 5)).astype(np.int32)
    y = ((pixels.mean(axis=(1, 2, 3)) > 0) + 2 * (tokens[:, 0] > 7)).astype(np.int32)
    return {"pixels": pixels, "tokens": tokens}, y


STRATEGIES = strategy_table(min_shard_size=64, model_rules=TENSOR_RULES)


def train(model, strategy, data, optimizer=None):
    trainer = tk.Trainer(
        model,
        loss="sparse_categorical_crossentropy",
        optimizer=optimizer or optax.adam(0.01),
        metrics=["accuracy"],
        strategy=strategy,
        seed=1,
    )
    # 44 rows in batches of 16: the last batch holds 12 real rows and 4 padded ones
    trainer.fit(data, epochs=2, batch_size=16, verbose=0)
    return trainer


@pytest.fixture(scope="module")
def mixed():
    data = mixed_data()
    return data, {name: train(Mixed(), make(), data) for name, make in STRATEGIES.items()}


@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "single"])
def test_mixed_layers_match_single_device(mixed, name):
    data, trainers = mixed
    tree_allclose(trainers[name].params, trainers["single"].params, rtol=2e-5, atol=2e-6)
    single, other = trainers["single"], trainers[name]
    e1, e2 = single.evaluate(data, batch_size=8, return_dict=True), other.evaluate(data, batch_size=8, return_dict=True)
    assert e1["loss"] == pytest.approx(e2["loss"], rel=1e-5)
    assert e1["accuracy"] == e2["accuracy"]
    np.testing.assert_allclose(
        other.predict(data[0], batch_size=8), single.predict(data[0], batch_size=8), rtol=1e-4, atol=1e-5
    )


def test_tensor_parallel_rules_place_the_state(mixed):
    state = mixed[1]["hybrid2x4_model"].state
    assert state.params["Embed_0"]["embedding"].sharding.spec == P(None, "model")
    assert state.params["Conv_0"]["kernel"].addressable_shards[0].data.shape == (3, 3, 1, 2)
    mu = state.opt_state[0].mu  # Adam's moments follow the rule of their parameter
    assert mu["Dense_1"]["kernel"].sharding.spec == P("model", None)


@pytest.mark.parametrize("name", ["fsdp8", "hybrid2x4_fsdp", "hybrid2x4_model"])
def test_batchnorm_and_dropout_agree_under_jit_strategies(name):
    data = mixed_data(seed=1)
    # SGD, not Adam: BatchNorm over 16 rows leaves some gradient elements near Adam's eps, where
    # Adam turns a rounding difference of the all-reduce into a whole step of difference.
    single = train(Mixed(noisy=True), tk.SingleDevice(), data, optax.sgd(0.05))
    other = train(Mixed(noisy=True), STRATEGIES[name](), data, optax.sgd(0.05))
    # batch statistics span the global batch; dropout masks do not depend on the sharding. The
    # padded rows repeat real rows (#60) and so enter the statistics with values, not zeros: the
    # all-reduce's order then rounds more (max difference 3.8e-5; 4.8e-6 with zero rows)
    tree_allclose(other.get_weights(), single.get_weights(), rtol=1e-4, atol=1e-4)


class BNOnly(nn.Module):
    """BatchNorm without Dropout (dropout masks differ per device under DataParallel by design)."""

    bn_axis: str | None = None

    @nn.compact
    def __call__(self, pixels, tokens, train: bool = False):
        flat = jnp.concatenate([pixels.reshape(pixels.shape[0], -1), tokens.astype(jnp.float32)], -1)
        h = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.bn_axis)(
            nn.Dense(16, use_bias=False)(flat)
        )
        return nn.Dense(4)(nn.relu(h))


def test_dataparallel_batchnorm_matches_only_with_the_named_axis():
    """Under pmap, BatchNorm sees one device's rows unless it reduces over axis_name="data"."""
    data = mixed_data(48, seed=2)  # no padded rows: they would enter per-device statistics
    expected = train(BNOnly(), tk.SingleDevice(), data)
    named = train(BNOnly(bn_axis="data"), tk.DataParallel(), data)
    local = train(BNOnly(), tk.DataParallel(), data)
    tree_allclose(named.get_weights(), expected.get_weights(), rtol=2e-5, atol=2e-6)
    close = jax.tree.leaves(
        jax.tree.map(lambda a, b: np.allclose(a, b, rtol=1e-4), local.get_weights(), expected.get_weights())
    )
    assert not all(close)  # per-device statistics: a different (equally valid) model


def per_device_bytes(tree):
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


def test_fsdp_holds_an_eighth_of_the_state_per_device():
    x = np.zeros((16, 64), np.float32)
    sizes = {}
    for name, strategy in (("single", tk.SingleDevice()), ("fsdp", tk.FSDP())):
        trainer = tk.Trainer(Wide(), loss="mse", optimizer=optax.adam(1e-3), strategy=strategy)
        state = trainer.init(x)
        sizes[name] = per_device_bytes((state.params, state.opt_state))
    assert sizes["fsdp"] <= 1.1 * sizes["single"] / 8, sizes


def test_fsdp_creates_the_state_sharded_without_a_whole_copy():
    trainer = tk.Trainer(Wide(), loss="mse", optimizer=optax.adam(1e-3), strategy=tk.FSDP())
    state = trainer.init(np.zeros((16, 64), np.float32))
    kernel = state.params["Dense_1"]["kernel"]
    assert kernel.sharding.spec == P("fsdp") or kernel.sharding.spec == P(None, "fsdp")
    assert {s.data.shape for s in kernel.addressable_shards} in ({(32, 256)}, {(256, 32)})


# ---------------------------------------------------------------------- errors before compiling
def test_hybrid_sizes_must_multiply_to_the_device_count():
    with pytest.raises(ValueError, match=r"hold 6 devices, but 8 devices"):
        tk.Hybrid(data=2, fsdp=3).mesh  # noqa: B018


def test_hybrid_needs_a_second_axis():
    with pytest.raises(ValueError, match="needs an fsdp, a model, a context or a stage axis"):
        tk.Hybrid(data=8)


def test_rule_naming_an_unknown_axis():
    with pytest.raises(ValueError, match=r"names the mesh axis 'tensor'.*\('data', 'model'\)"):
        tk.Hybrid(data=2, model=4, rules=[(r"kernel", P(None, "tensor"))])


def test_rule_on_a_dimension_that_does_not_divide():
    strategy = tk.Hybrid(data=2, model=4, rules=[(r"kernel", P(None, "model"))])
    trainer = tk.Trainer(nn.Dense(6), loss="mse", optimizer=optax.sgd(0.1), strategy=strategy)
    with pytest.raises(ValueError, match=r"params/kernel of shape \(3, 6\): dimension 1 has size 6, which 4"):
        trainer.init(np.zeros((8, 3), np.float32))


def test_leaf_matched_by_two_rules():
    strategy = tk.FSDP(rules=[(r"kernel", P()), (r"Dense_0", P())])
    trainer = tk.Trainer(Wide(), loss="mse", optimizer=optax.sgd(0.1), strategy=strategy)
    with pytest.raises(ValueError, match=r"params/Dense_0/kernel \(64, 256\) matches 2 rules"):
        trainer.init(np.zeros((8, 64), np.float32))


def test_batch_the_mesh_cannot_split():
    trainer = tk.Trainer(Wide(), loss="mse", optimizer=optax.sgd(0.1), strategy=tk.Hybrid(data=2, fsdp=4))
    with pytest.raises(ValueError, match="8"):
        trainer.fit((np.zeros((20, 64), np.float32), np.zeros((20, 8), np.float32)), batch_size=12, verbose=0)
