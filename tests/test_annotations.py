"""Flax partitioning annotations: parameters created with ``nn.with_logical_partitioning`` (and
``nn.with_partitioning``, and NNX ``out_sharding`` metadata) are placed by the strategy's logical rules,
their optimizer moments follow them, unannotated leaves keep the default, activations
constrained with ``nn.with_logical_constraint`` work under the trainer's mesh, and the results
equal ``SingleDevice``'s."""

import pathlib
import sys

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import trainkit as tk

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))
from lm import RULES, ByteLM  # noqa: E402

LENGTH, BATCH = 16, 8


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(4 * BATCH, LENGTH + 1)).astype(np.int32)
    return data[:, :-1], data[:, 1:]


def make(strategy, model=None):
    return tk.Trainer(
        model or ByteLM(layers=2, d_model=32, heads=4, mlp=64, max_len=LENGTH),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.adam(1e-3),
        strategy=strategy,
    )


def specs(trainer):
    """``{leaf name: PartitionSpec}`` of the live state."""
    leaves = jax.tree_util.tree_flatten_with_path(trainer.state)[0]
    return {tk.strategies._sharding.leaf_name(path): leaf.sharding.spec for path, leaf in leaves}


def spec_of(found, suffix):
    (spec,) = [s for name, s in found.items() if name.endswith(suffix)]
    return tuple(spec)


def test_annotated_leaves_carry_the_rules_partition_spec_with_their_optimizer_moments(tokens):
    trainer = make(tk.Hybrid(data=2, model=4, rules=RULES["tp"]))
    trainer.init(tokens)
    found = specs(trainer)
    # Megatron: q/k/v split by heads (column parallel), the output projection by heads (row parallel)
    for kind in ("query", "key", "value"):
        assert spec_of(found, f"params/Block_0/Attention_0/{kind}") == (None, "model", None)
    assert spec_of(found, "params/Block_0/Attention_0/out") == ("model", None, None)
    assert spec_of(found, "params/Block_1/Dense_0/kernel") == (None, "model")  # embed x mlp
    assert spec_of(found, "params/Block_1/Dense_1/kernel") == ("model", None)  # mlp x embed
    assert spec_of(found, "params/Embed_0/embedding") == ("model", None)  # vocab x embed
    assert spec_of(found, "params/Dense_0/kernel") == (None, "model")  # embed x vocab
    # Adam's two moments follow their parameter
    moments = [n for n in found if n.endswith("Block_0/Attention_0/out") and n.startswith("opt_state")]
    assert len(moments) == 2 and all(tuple(found[n]) == ("model", None, None) for n in moments)


def test_fsdp_places_annotated_leaves_by_their_names_and_unannotated_ones_by_default(tokens):
    class Mixed(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(
                64, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            )(x)
            return nn.Dense(32)(x)  # not annotated: the largest dimension over fsdp

    trainer = tk.Trainer(
        Mixed(), loss="mse", optimizer=optax.adam(1e-3), strategy=tk.FSDP(rules=[("embed", None), ("mlp", "fsdp")])
    )
    trainer.init((np.ones((8, 16), np.float32), np.ones((8, 32), np.float32)))
    found = specs(trainer)
    assert spec_of(found, "params/Dense_0/kernel") == (None, "fsdp")  # by its names
    moments = [n for n in found if n.startswith("opt_state") and n.endswith("Dense_0/kernel")]
    assert len(moments) == 2 and all(tuple(found[n]) == (None, "fsdp") for n in moments)
    assert spec_of(found, "params/Dense_1/kernel") == ("fsdp",)  # 64 x 32: the default, the largest dimension
    assert spec_of(found, "params/Dense_1/bias") == ()  # small: replicated


@pytest.mark.parametrize("name", ["tp", "fsdp"])
def test_an_annotated_lm_trains_to_the_single_device_result(tokens, name):
    x, y = tokens
    strategy = tk.Hybrid(data=2, model=4, rules=RULES["tp"]) if name == "tp" else tk.FSDP(rules=RULES["fsdp"])
    runs = []
    for chosen in ("single", strategy):
        trainer = make(chosen)
        history = trainer.fit((x, y), batch_size=BATCH, epochs=1, verbose=0)
        runs.append((trainer, history))
    (single, single_history), (sharded, sharded_history) = runs
    np.testing.assert_allclose(sharded_history.history["loss"], single_history.history["loss"], rtol=2e-5)
    for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(sharded.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)


def constraints(trainer, batch):
    """The sharding constraints in the lowered train step (Shardy's or GSPMD's spelling)."""
    trainer.init(batch)
    text = trainer.lowered_text(batch)
    return [line for line in text.splitlines() if "sharding_constraint" in line or "@Sharding" in line]


def test_a_logical_constraint_on_activations_reaches_the_compiled_step(tokens):
    tensor_parallel = make(tk.Hybrid(data=2, model=4, rules=RULES["tp"]))
    found = constraints(tensor_parallel, tokens)
    # ("batch", "length", "embed") -> ("data", None, None) on the residual stream: after the
    # embedding and after each block's attention and MLP (2 blocks), forward and backward
    assert len(found) >= 5 and all('"data"' in line or "data" in line for line in found), found
    assert constraints(make(tk.FSDP(min_shard_size=16)), tokens) == []  # no logical rules: no constraint


def test_a_name_the_rules_do_not_map_is_an_error_naming_the_parameter(tokens):
    rules = [r for r in RULES["tp"] if r[0] != "heads"]
    with pytest.raises(ValueError, match=r"params/Block_0/Attention_0/(query|key|value|out) is annotated .*'heads'"):
        make(tk.Hybrid(data=2, model=4, rules=rules)).init(tokens)


def test_a_rule_naming_a_mesh_axis_that_does_not_exist_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"maps to the mesh axis 'tensor'.*\('data', 'model'\)"):
        tk.Hybrid(data=2, model=4, rules=[("mlp", "tensor")])


def test_a_rule_that_cannot_split_an_annotated_dimension_names_the_parameter(tokens):
    with pytest.raises(
        ValueError, match=r"annotation of Block_0/Attention_0/(query|key|value).*dimension 1 has size 4"
    ):
        make(tk.Hybrid(data=1, model=8, rules=RULES["tp"])).init(tokens)  # 4 heads over 8 devices


def test_without_logical_rules_annotations_are_not_used(tokens):
    trainer = make(tk.FSDP(min_shard_size=16))
    trainer.init(tokens)
    assert spec_of(specs(trainer), "params/Block_0/Dense_0/kernel") == (None, "fsdp")  # 32 x 64: the largest


def test_nnx_out_sharding_metadata_places_parameters_too():
    import flax
    from flax import nnx

    previous = flax.config.flax_always_shard_variable
    flax.config.update("flax_always_shard_variable", False)  # names as metadata only, placed by trainkit
    try:

        class Net(nnx.Module):
            def __init__(self, rngs):
                self.up = nnx.Linear(16, 64, kernel_metadata={"out_sharding": ("embed", "mlp")}, rngs=rngs)
                self.down = nnx.Linear(64, 4, rngs=rngs)

            def __call__(self, x):
                return self.down(nnx.relu(self.up(x)))

        trainer = tk.Trainer(
            Net(nnx.Rngs(0)),
            loss="mse",
            optimizer=optax.sgd(0.1),
            strategy=tk.FSDP(rules=[("embed", None), ("mlp", "fsdp")]),
        )
        trainer.init((np.ones((8, 16), np.float32), np.ones((8, 4), np.float32)))
        assert spec_of(specs(trainer), "params/up/kernel") == (None, "fsdp")
    finally:
        flax.config.update("flax_always_shard_variable", previous)


def test_the_plan_of_a_tensor_parallel_lm_shows_per_device_bytes_and_collective_traffic(tokens):
    trainer = make("single")
    plan = trainer.plan(
        tokens, candidates=[tk.SingleDevice(), tk.Hybrid(data=2, model=4, rules=RULES["tp"])], verbose=0
    )
    single, tensor = plan.rows
    assert single.error is None and tensor.error is None, (single.error, tensor.error)
    assert tensor.argument_bytes < single.argument_bytes  # the parameters split over model
    assert tensor.collective_bytes > 0 and single.collective_bytes == 0


def test_the_strategy_given_is_configured_by_copy_not_changed(tokens):
    given = tk.Hybrid(data=2, model=4, rules=RULES["tp"])
    trainer = make(given)
    trainer.init(tokens)
    assert given.param_axes == {}, "the user's strategy object was mutated"
    assert trainer.strategy is not given and trainer.strategy.param_axes
    assert spec_of(specs(trainer), "params/Block_1/Dense_0/kernel") == (None, "model")
