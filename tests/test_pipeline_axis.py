"""The pipeline axis (#62): ``Hybrid(data=2, stage=4, microbatches=8)`` splits a causal LM's stacked
blocks (``nn.scan``, 4 layers) into 4 stages and runs each step's rows through them as 8 microbatches
(GPipe); it trains to SingleDevice's numbers, each stage holds a quarter of the blocks, and wrong use
is refused before anything compiles."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import check_resumes_and_loads_elsewhere, check_trains_like_single_device
from flax import nnx
from jax.sharding import PartitionSpec as P

import trainkit as tk
from trainkit.strategies.pipeline import bubble_fraction

SEQUENCE, WIDTH, VOCAB, HEADS, LAYERS = 512, 64, 64, 4, 4


class Block(nn.Module):
    """One transformer block as ``nn.scan`` takes it: ``(carry, per-layer input) -> (carry, output)``."""

    @nn.compact
    def __call__(self, x, _):
        b, t, w = x.shape
        q, k, v = (a.reshape(b, t, HEADS, w // HEADS) for a in jnp.split(nn.Dense(3 * w)(nn.LayerNorm()(x)), 3, -1))
        attended = nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(jnp.ones((b, t))))
        x = x + nn.Dense(w)(attended.reshape(b, t, w))
        return x + nn.Dense(w)(nn.gelu(nn.Dense(4 * w)(nn.LayerNorm()(x)))), None


class StackedLM(nn.Module):
    """A causal LM whose blocks are one stacked module: each parameter leads with the layer axis."""

    layers: int = LAYERS

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH)(tokens) + nn.Embed(SEQUENCE, WIDTH)(jnp.arange(tokens.shape[1]))
        stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers)
        x, _ = stack(name="blocks")(x, None)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


class UnstackedLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH)(tokens)
        for _ in range(2):
            x, _ = Block()(x, None)
        return nn.Dense(VOCAB)(x)


def data(rows, sequence=SEQUENCE):
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(rows, sequence + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def lm(strategy, model=None):
    """SGD, as the context axis's test: Adam would turn gradients that are zero but for rounding into full steps."""
    return tk.Trainer(
        model or StackedLM(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy=strategy
    )


PIPELINE = dict(data=2, stage=4, microbatches=8)


def test_a_stacked_lm_on_a_pipeline_trains_to_single_devices_numbers():
    """3 steps of 16 rows (2 data groups x 8 microbatches of one row), the last batch padded."""
    x, y = data(16 * 2 + 5, sequence=128)
    check_trains_like_single_device(lm, tk.Hybrid(**PIPELINE), x, y, batch_size=16, steps=3)


TENSOR_PARALLEL = [  # Megatron's split inside each stage: qkv and the MLP's first layer by columns, the others by rows
    (r"blocks/Dense_(0|3)/kernel", P(None, None, "model")),
    (r"blocks/Dense_(1|2)/kernel", P(None, "model", None)),
]


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(lambda: tk.Hybrid(data=2, stage=2, model=2, microbatches=4, rules=TENSOR_PARALLEL), id="model"),
        pytest.param(lambda: tk.Hybrid(data=2, stage=2, context=2, microbatches=4), id="context"),
    ],
)
def test_a_pipeline_composes_with_tensor_parallel_rules_or_a_context_axis_inside_each_stage(strategy):
    x, y = data(8 * 2 + 3, sequence=64)  # short: the run above shows the schedule's numbers on longer rows
    check_trains_like_single_device(lm, strategy(), x, y, batch_size=8, steps=3)
    trainer = lm(strategy())
    trainer.init(x[:1])
    if "model" in trainer.strategy.mesh.shape:
        assert trainer.state.params["blocks"]["Dense_0"]["kernel"].sharding.spec == P("stage", None, "model")


def test_a_rule_splitting_the_layer_axis_the_stages_take_is_refused_naming_the_fix():
    rules = [(r"blocks/Dense_0/kernel", P("model", None, None))]
    trainer = lm(tk.Hybrid(data=2, stage=2, model=2, microbatches=4, rules=rules))
    with pytest.raises(
        ValueError,
        match=r"the stacked blocks' layer axis, which the stage axis splits.*None there: P\(None, 'model', None\)",
    ):
        trainer.init(data(1)[0])


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return x + nnx.tanh(self.linear(x))


class NNXStacked(nnx.Module):
    """NNX's stacked blocks: built by nnx.vmap, run by nnx.scan."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return NNXBlock(rngs)

        self.embed, self.blocks, self.head = (
            nnx.Linear(8, WIDTH, rngs=rngs),
            create(rngs),
            nnx.Linear(WIDTH, 3, rngs=rngs),
        )

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        return self.head(forward(self.embed(x), self.blocks))


def test_an_nnx_model_stacked_with_vmap_and_scan_trains_on_a_pipeline_to_single_devices_numbers():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(37, 8)).astype(np.float32), rng.integers(0, 3, 37)
    check_trains_like_single_device(lambda s: lm(s, NNXStacked(nnx.Rngs(0))), tk.Hybrid(**PIPELINE), x, y, 16, steps=3)
    trainer = lm(tk.Hybrid(**PIPELINE), NNXStacked(nnx.Rngs(0)))
    trainer.init(x[:1])
    assert trainer.strategy.stage_paths == ("blocks/linear/bias", "blocks/linear/kernel")


def test_each_stage_holds_a_quarter_of_the_blocks_and_the_plan_shows_gpipes_bubble():
    x, y = data(16)
    trainer = lm(tk.Hybrid(**PIPELINE))
    trainer.init(x[:1])
    blocks = trainer.state.params["blocks"]
    for leaf in jax.tree.leaves(blocks):
        assert leaf.shape[0] == LAYERS
        held = {shard.data.shape[0] for shard in leaf.addressable_shards}
        assert held == {LAYERS // 4}, held  # one layer on each device: a quarter of the blocks
    fsdp = lm(tk.Hybrid(stage=4, fsdp=2, microbatches=8, min_shard_size=1))
    fsdp.init(x[:1])
    kernel = fsdp.state.params["blocks"]["Dense_3"]["kernel"]  # (4, 64, 256): a layer per stage, halved inside
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("stage", None, "fsdp"), kernel.sharding.spec
    assert {shard.data.shape for shard in kernel.addressable_shards} == {(1, 64, 128)}
    embedding = trainer.state.params["Embed_0"]["embedding"]
    assert {shard.data.shape for shard in embedding.addressable_shards} == {embedding.shape}  # outside the stages
    plan = lm("single").plan((x, y), batch_size=16, candidates=[tk.Hybrid(**PIPELINE)], verbose=0)
    (row,) = plan.rows
    assert row.error is None, row.error
    assert row.bubble == pytest.approx((4 - 1) / (8 + 4 - 1)) == bubble_fraction(stages=4, microbatches=8)
    assert "waits 27.3% of a step" in str(plan)
    # a pipeline: activations passed from stage to stage, no stacked parameter gathered
    assert row.collectives.get("collective-permute", 0) > 0 and "all-gather" not in row.collectives, row.collectives


@pytest.mark.parametrize(
    ("model", "batch_size", "match"),
    [
        (UnstackedLM(), 16, "repeated blocks stacked into one scan over their layers, and this model has none"),
        (StackedLM(layers=6), 16, "6 layers, which do not divide into 4 stages"),
        (StackedLM(), 8, r"cannot be split evenly across 2 devices x 8 pipeline microbatches"),
    ],
    ids=["no-stacked-blocks", "layers-not-divisible", "microbatches-do-not-divide-the-batch"],
)
def test_wrong_use_of_a_pipeline_is_refused_before_anything_compiles(model, batch_size, match):
    x, y = data(16, sequence=32)
    trainer = lm(tk.Hybrid(**PIPELINE), model)
    with pytest.raises(ValueError, match=match):
        trainer.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
    assert trainer.global_step == 0


def test_hybrid_refuses_microbatches_without_a_stage_axis():
    with pytest.raises(ValueError, match="there is no stage axis"):
        tk.Hybrid(data=2, fsdp=4, microbatches=8)


@pytest.mark.parametrize("axis", ["context", "stage"])
def test_data_parallel_refuses_a_context_or_a_stage_axis_naming_hybrid(axis):
    with pytest.raises(ValueError, match=rf"cannot split .* Use tk.Hybrid\(data=\.\.\., {axis}=4\)"):
        tk.DataParallel(**{axis: 4})


def test_a_context_size_that_does_not_divide_the_sequence_is_refused_naming_the_fix():
    tokens = np.zeros((4, 30), np.int32)
    trainer = lm(tk.Hybrid(data=2, context=4), UnstackedLM())
    with pytest.raises(ValueError, match="30 positions along sequence_axis=1, which do not split evenly over the 4"):
        trainer.fit(tokens, tokens, batch_size=2, epochs=1, verbose=0)
    assert trainer.global_step == 0


def test_a_pipeline_run_resumes_bit_exact_and_its_checkpoint_loads_onto_single_device_and_fsdp(tmp_path):
    """The stacked parameters are saved in the model's own layout (layers, ...), whatever the stages."""
    x, y = data(32, sequence=64)
    check_resumes_and_loads_elsewhere(lm, lambda: tk.Hybrid(**PIPELINE), x, y, 16, tmp_path / "checkpoint")


def test_across_two_tpu_slices_a_pipeline_sends_activations_where_data_parallelism_sends_gradients():
    """Compiled by libtpu for two v5p slices of 4 chips (not run): a model of wide blocks and short sequences,
    whose gradients outweigh its activations; the plan's dcn column reads the compiler's sends between slices."""
    pytest.importorskip("libtpu")

    class Wide(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(VOCAB, 256)(tokens)
            stack = nn.scan(Dense256, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)
            x, _ = stack()(x, None)
            return nn.Dense(VOCAB)(x)

    x, y = data(16, sequence=32)
    plan = lm("single", Wide()).plan((x, y), batch_size=16, target="tpu v5p:2x2x1 x2", verbose=0)
    rows = {row.name: row for row in plan.rows}
    assert set(rows) >= {"Hybrid(data=2, fsdp=4)", "Hybrid(stage=2, data=1, fsdp=4)"}, set(rows)  # by default
    data_parallel, pipeline = rows["Hybrid(data=2, fsdp=4)"], rows["Hybrid(stage=2, data=1, fsdp=4)"]
    assert data_parallel.error is None and pipeline.error is None, (data_parallel.error, pipeline.error)
    blocks = 4 * (256 * 4096 + 4096 + 4096 * 256 + 256)  # the stacked blocks' parameters
    assert data_parallel.dcn_bytes >= 4 * blocks / 4  # every block gradient (f32), a quarter per device
    # each microbatch's activations to the next stage and the last stage's to the head, forward and back
    activations = 2 * 2 * 16 * 32 * 256 * 4 / 4
    assert activations <= pipeline.dcn_bytes < 0.2 * data_parallel.dcn_bytes, (pipeline.dcn_bytes, activations)
    assert "dcn" in str(plan)


class Dense256(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(256)(nn.relu(nn.Dense(4096)(x))), None


class SowingLM(nn.Module):
    """Sows a scalar (an auxiliary loss): one value per batch, which microbatches cannot be put back into."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH)(tokens)
        stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)
        x, _ = stack(name="blocks")(x, None)
        self.sow("losses", "activity", jnp.mean(x**2))
        return nn.Dense(VOCAB)(x)


def test_a_model_returning_a_value_that_does_not_lead_with_the_rows_is_refused_naming_why():
    x, y = data(16, sequence=32)
    trainer = lm(tk.Hybrid(**PIPELINE), SowingLM())
    with pytest.raises(ValueError, match=r"does not lead with its rows \(2 a microbatch\)"):
        trainer.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert trainer.global_step == 0


class DropoutBlock(nn.Module):
    train: bool = False

    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dropout(0.5, deterministic=not self.train)(nn.Dense(x.shape[-1])(x)), None


class DropoutLM(nn.Module):
    @nn.compact
    def __call__(self, tokens, train: bool = False):
        x = nn.Embed(VOCAB, WIDTH)(tokens)
        stack = nn.scan(
            DropoutBlock, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True}, length=4
        )
        x, _ = stack(train, name="blocks")(x, None)
        return nn.Dense(VOCAB)(x)


def test_with_dropout_each_microbatch_draws_its_own_masks():
    """Masks are drawn per microbatch (fold_in of the step's key): other masks than one device's, so the
    losses differ from SingleDevice's, but they train and evaluate (no dropout) to finite, close numbers."""
    x, y = data(32, sequence=32)
    losses = {}
    for name, strategy in (("single", "single"), ("pipeline", tk.Hybrid(**PIPELINE))):
        trainer = lm(strategy, DropoutLM())
        history = trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
        losses[name] = (history["loss"], trainer.evaluate(x, y, batch_size=16, verbose=0))
    assert np.all(np.isfinite(losses["pipeline"][0]))
    assert not np.allclose(losses["pipeline"][0], losses["single"][0], rtol=1e-6)  # other masks
    np.testing.assert_allclose(losses["pipeline"][0], losses["single"][0], rtol=0.1)
