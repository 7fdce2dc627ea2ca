"""Fine-tuning: frozen parameters (``Trainer(trainable=...)``) never change, carry no optimizer
state and train the same on every strategy."""

import random
import re
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, classifier, make_classification

import trainkit as tk


def frozen_trainer(strategy="single", trainable=r"^Dense_1/", model=None):
    return classifier(model, optimizer=optax.adam(1e-2), strategy=strategy, trainable=trainable)


def optimizer_arrays(state):
    return [leaf for leaf in jax.tree.leaves(state.opt_state) if np.ndim(leaf) > 0]


@pytest.fixture(scope="module")
def trained():
    x, y = make_classification(64)
    trainer = frozen_trainer()
    trainer.init(x)
    before = jax.tree.map(np.asarray, trainer.get_weights())
    trainer.fit(x, y, batch_size=16, epochs=2, verbose=0)
    return trainer, before, (x, y)


def test_frozen_leaves_are_bit_identical_after_fit_and_the_others_train(trained):
    trainer, before, _ = trained
    after = trainer.get_weights()["params"]
    for name in ("kernel", "bias"):
        np.testing.assert_array_equal(after["Dense_0"][name], before["params"]["Dense_0"][name])
        assert not np.array_equal(after["Dense_1"][name], before["params"]["Dense_1"][name])


def test_frozen_leaves_carry_no_optimizer_state(trained):
    trainer, _, (x, _) = trained
    full = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2), strategy="single")
    full.init(x)
    head = [a.shape for a in jax.tree.leaves(trainer.state.params["Dense_1"])]
    # Adam's two moments, for the head's leaves only
    assert sorted(a.shape for a in optimizer_arrays(trainer.state)) == sorted(head * 2)
    assert len(optimizer_arrays(full.state)) == 2 * len(jax.tree.leaves(full.state.params))


def test_the_plan_and_summary_show_the_frozen_parameters(trained, capsys):
    trainer, _, (x, y) = trained
    full = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2), strategy="single")
    frozen_plan = trainer.plan((x[:16], y[:16]), verbose=0).state_bytes
    full_plan = full.plan((x[:16], y[:16]), verbose=0).state_bytes
    assert frozen_plan["optimizer state"] < full_plan["optimizer state"]
    assert frozen_plan["frozen params"] == 4 * (5 * 16 + 16) and full_plan["frozen params"] == 0
    assert "frozen params" in str(trainer.plan((x[:16], y[:16]), verbose=0))
    trainer.summary()
    printed = capsys.readouterr().out
    assert f"Trainable params: {16 * 3 + 3:,}" in printed and f"Non-trainable params: {5 * 16 + 16:,}" in printed


@pytest.mark.parametrize("strategy", ["dp", "fsdp", "hybrid"])
def test_every_strategy_trains_the_same_frozen_model(trained, strategy):
    trainer, _, (x, y) = trained
    other = frozen_trainer(
        {"dp": tk.DataParallel, "fsdp": lambda: tk.FSDP(min_shard_size=1),
         "hybrid": lambda: tk.Hybrid(data=2, fsdp=4, min_shard_size=1)}[strategy]()
    )  # fmt: skip
    other.fit(x, y, batch_size=16, epochs=2, verbose=0)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), trainer.get_weights(), other.get_weights()
    )
    np.testing.assert_array_equal(other.get_weights()["params"]["Dense_0"]["kernel"],
                                  trained[1]["params"]["Dense_0"]["kernel"])  # fmt: skip


def test_a_callable_or_a_list_selects_the_same_leaves():
    x, y = make_classification(32)
    by_list = frozen_trainer(trainable=[r"^Dense_1/kernel$", r"^Dense_1/bias$"])
    by_callable = frozen_trainer(trainable=lambda path, leaf: path.startswith("Dense_1/"))
    for trainer in (by_list, by_callable):
        trainer.fit(x, y, batch_size=16, epochs=1, verbose=0)
    jax.tree.map(np.testing.assert_array_equal, by_list.get_weights(), by_callable.get_weights())


def test_a_spec_that_matches_nothing_is_refused_before_training():
    x, y = make_classification(32)
    trainer = frozen_trainer(trainable=r"^dense_1/")  # lowercase: matches no parameter
    with pytest.raises(ValueError, match=r"matches none of the model's parameters.*'Dense_0/bias'"):
        trainer.fit(x, y, batch_size=16, epochs=1, verbose=0)
    with pytest.raises(TypeError, match="trainable= takes a regex"):
        frozen_trainer(trainable=3)


# ---------------------------------------------------------------------------------------------- LoRA
class Body(nn.Module):
    """A small CNN: conv, a hidden Dense and a head (linen, no LoRA inside)."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Conv(8, (3, 3), name="conv")(x)).mean(axis=(1, 2))
        x = nn.relu(nn.Dense(32, name="hidden")(x))
        return nn.Dense(4, name="head")(x)


def images(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6, 6, 2)).astype(np.float32)
    return x, (x[:, :3, :3, 0].mean(axis=(1, 2)) > 0).astype(np.int32) + 2 * (x[:, 3:, 3:, 1].mean(axis=(1, 2)) > 0)


@pytest.fixture(scope="module")
def base_weights(tmp_path_factory):
    """A trained base model, published as safetensors."""
    x, y = images()
    base = tk.Trainer(Body(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2), strategy="single")
    base.fit(x, y, batch_size=16, epochs=3, verbose=0)
    path = tmp_path_factory.mktemp("base") / "base.safetensors"
    base.save_weights(path)
    return base, path


def lora_trainer(path, strategy="single", **lora):
    trainer = tk.Trainer(
        Body(),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.adam(1e-2),
        strategy=strategy,
        lora=tk.LoRA(**{"rank": 2, "alpha": 4.0, **lora}),
    )
    trainer.init(images(16)[0])
    tk.weights.load(path, into=trainer)
    return trainer


@pytest.fixture(scope="module")
def lora_trained(base_weights):
    base, path = base_weights
    trainer = lora_trainer(path)
    x, y = images(seed=1)
    step0 = trainer.predict(x)
    before = trainer.get_weights()
    trainer.fit(x, y, batch_size=16, epochs=2, verbose=0)
    return trainer, step0, before, (x, y)


def names(tree):
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def test_lora_at_step_0_predicts_as_the_base_and_then_only_adapters_change(base_weights, lora_trained):
    base, _ = base_weights
    trainer, step0, before, (x, _) = lora_trained
    np.testing.assert_array_equal(step0, base.predict(x))
    after = trainer.get_weights()
    changed = [
        n for n, a, b in zip(names(before), jax.tree.leaves(before), jax.tree.leaves(after)) if not np.array_equal(a, b)
    ]
    assert changed and all(n.endswith(("_lora_a']", "_lora_b']")) for n in changed)
    assert len(changed) == 6  # A and B of the conv, hidden and head kernels
    adapters = sum(np.size(a) for n, a in zip(names(after), jax.tree.leaves(after)) if "_lora_" in n)
    assert sum(np.size(a) for a in optimizer_arrays(trainer.state)) == 2 * adapters  # Adam's moments: adapters only


def test_merge_lora_and_export_give_the_merged_model(lora_trained, tmp_path):
    trainer, _, _, (x, _) = lora_trained
    merged = trainer.merge_lora()
    assert sorted(merged.get_weights()["params"]["hidden"]) == ["bias", "kernel"]
    np.testing.assert_allclose(merged.predict(x), trainer.predict(x), atol=1e-5)
    trainer.export(tmp_path / "lora.jax", verbose=False)
    np.testing.assert_allclose(np.asarray(tk.export.load(tmp_path / "lora.jax")(x)), trainer.predict(x), atol=1e-5)
    trainer.save_weights(tmp_path / "merged.safetensors")  # a plain model: loads into the base strictly
    plain = tk.Trainer(Body(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single")
    plain.init(x)
    tk.weights.load(tmp_path / "merged.safetensors", into=plain)
    np.testing.assert_allclose(plain.predict(x), trainer.predict(x), atol=1e-5)


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_every_strategy_trains_the_same_adapters(base_weights, lora_trained, strategy):
    _, path = base_weights
    reference, _, _, (x, y) = lora_trained
    other = lora_trainer(path, {"dp": tk.DataParallel, "fsdp": lambda: tk.FSDP(min_shard_size=1)}[strategy]())
    other.fit(x, y, batch_size=16, epochs=2, verbose=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), reference.get_weights(), other.get_weights())
    if strategy == "fsdp":  # A follows the kernel's input axes, B its output axis
        params = other.state.params["hidden"]
        kernel = tuple(params["kernel"].sharding.spec) + (None,) * 2
        assert tuple(params["kernel_lora_a"].sharding.spec) == (kernel[0], None)
        assert tuple(params["kernel_lora_b"].sharding.spec) == (None, kernel[1])


def test_an_adapter_checkpoint_holds_the_adapters_and_refuses_another_base(lora_trained, base_weights, tmp_path):
    trainer, _, _, (x, y) = lora_trained
    _, path = base_weights
    trainer.save(tmp_path / "lora")
    manifest = trainer.manifest()
    assert manifest["lora"]["base_source"] == str(path) and len(manifest["lora"]["base_sha256"]) == 64
    restored = lora_trainer(path)
    restored.load(tmp_path / "lora")
    jax.tree.map(np.testing.assert_array_equal, trainer.get_weights(), restored.get_weights())
    written = ocp_tree(tmp_path / "lora")
    assert all(n.endswith(("_lora_a']", "_lora_b']")) for n in written if n.startswith("['params']"))
    other = lora_trainer(path)
    other.set_weights(jax.tree.map(lambda a: a * 1.01, other.get_weights()))  # another base
    with pytest.raises(tk.CheckpointError, match="trained on other base weights"):
        other.load(tmp_path / "lora")
    plain = tk.Trainer(Body(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2), strategy="single")
    plain.init(x)
    tk.weights.load(path, into=plain)
    with pytest.raises(tk.CheckpointError, match=r"holds LoRA adapters \(tk.LoRA\(rank=2, .*this trainer has none"):
        plain.load(tmp_path / "lora")
    quantised = lora_trainer(path, quantize_base="int8")
    floats_into_int8 = r"stored in floats \(no quantize_base\); this trainer's base is stored quantised as int8"
    with pytest.raises(tk.CheckpointError, match=floats_into_int8):
        quantised.load(tmp_path / "lora")


def ocp_tree(directory):
    import orbax.checkpoint as ocp

    step = max(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    metadata = ocp.StandardCheckpointer().metadata(directory / str(step) / "state").item_metadata.tree
    return names(metadata)


def test_qlora_trains_with_the_base_stored_quantised(base_weights):
    _, path = base_weights
    x, y = images(seed=1)
    trainer = lora_trainer(path, quantize_base="nf4")
    hidden = trainer.state.params["hidden"]["kernel"]
    assert str(hidden.array.qvalue.dtype) == "uint4"  # stored quantised
    history = trainer.fit(x, y, batch_size=16, epochs=4, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert str(trainer.state.params["hidden"]["kernel"].array.qvalue.dtype) == "uint4"
    qvalue = hidden.array.qvalue  # NumPy's itemsize of uint4 is a byte; a device stores 4 bits, as the plan counts
    assert tk.plan.state_bytes_per_device(qvalue, qvalue.sharding) == qvalue.size // 2 == qvalue.nbytes // 2


def test_lora_settings_that_cannot_work_are_named(base_weights):
    with pytest.raises(ValueError, match=r"LoRA\(targets='\('\) is not a regular expression .*module paths"):
        tk.LoRA(targets="(")
    _, path = base_weights
    with pytest.raises(
        ValueError, match=r"lora=tk.LoRA\(targets='Attention'\) matches no module .*nothing would train"
    ):
        lora_trainer(path, targets="Attention")
    with pytest.raises(ValueError, match=r"trainable='\[' is not a regular expression"):
        tk.Trainer(Body(), loss="mse", optimizer=optax.sgd(0.1), trainable="[")


class EinsumHeads(nn.Module):
    """Attention-shaped kernels used through jnp.einsum ((features, heads, dim), three of one shape)."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        q, k, v = (jnp.einsum("bd,dhk->bhk", x, self.param(n, init, (x.shape[-1], 2, 4))) for n in "qkv")
        out = self.param("out", init, (2, 4, 3))
        return jnp.einsum("bhk,hkc->bc", q * k + v, out)


def test_lora_adapts_kernels_used_through_einsum_and_merges_them():
    """qwix records an einsum's LoRA equation on the module, which a linen module refused
    (SetAttributeFrozenModuleError); the adapters of a 3-D kernel fold back into it."""
    x, y = make_classification(64, features=8)
    trainer = tk.Trainer(
        EinsumHeads(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2), strategy="single",
        lora=tk.LoRA(rank=2, alpha=4.0),
    )  # fmt: skip
    trainer.fit(x, y % 3, batch_size=16, epochs=2, verbose=0)
    params = trainer.state.params
    assert (params["q_lora_a"].shape, params["q_lora_b"].shape) == ((8, 2), (2, 2, 4))
    assert (params["out_lora_a"].shape, params["out_lora_b"].shape) == ((2, 4, 2), (2, 3))
    assert float(np.abs(params["q_lora_b"]).max()) > 0  # trained: LoRA's b starts at zero
    np.testing.assert_allclose(trainer.merge_lora().predict(x), trainer.predict(x), rtol=1e-5, atol=1e-5)
    qlora = tk.Trainer(
        EinsumHeads(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2), strategy="single",
        lora=tk.LoRA(rank=2, quantize_base="nf4"),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"(?s)Multiple candidate params.*a quantised base.*targets='Dense'"):
        qlora.fit(x, y % 3, batch_size=16, epochs=1, verbose=0)  # q, k and v reach their einsums dequantised


class WithCounter(nn.Module):
    """A Dense layer beside an integer parameter (a lookup table of ids, say)."""

    @nn.compact
    def __call__(self, x):
        self.param("ids", lambda _: jnp.arange(3, dtype=jnp.int32))
        return nn.Dense(2)(x)


def test_an_integer_parameter_is_refused_unless_frozen_naming_trainable():
    x, y = make_classification(16)
    trainer = tk.Trainer(
        WithCounter(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single"
    )
    with pytest.raises(
        ValueError, match=r"not floats and cannot be trained .*\['ids \(int32\)'\]. Freeze them with trainable="
    ):
        trainer.fit(x, y % 2, batch_size=8, epochs=1, verbose=0)
    frozen = tk.Trainer(
        WithCounter(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single",
        trainable=r"Dense",
    )  # fmt: skip
    frozen.fit(x, y % 2, batch_size=8, epochs=1, verbose=0)
    np.testing.assert_array_equal(frozen.get_weights()["params"]["ids"], np.arange(3))


def test_lora_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        tk.LoRA(rank=0)
    with pytest.raises(ValueError, match="quantize_base='int4' is not one of"):
        tk.LoRA(quantize_base="int4")
    with pytest.raises(ValueError, match="no LoRA adapters"):
        trainer = frozen_trainer()
        trainer.init(make_classification(8)[0])
        trainer.merge_lora()


def test_a_lora_run_killed_with_sigkill_resumes_bit_identical(tmp_path):
    """BackupAndRestore of a LoRA run: the backups hold the adapters; a kill -9 and a rerun
    (which loads the same base first) finish with the uninterrupted run's parameters, bit for bit."""
    from test_faults import assert_bit_identical, committed_steps, finish, params, start, uninterrupted, wait_for

    reference, _ = uninterrupted(tmp_path / "reference", "--lora")
    backup = tmp_path / "backup"
    process = start(backup, tmp_path / "out.npz", "--sleep", "0.03", "--lora")
    wait_for(lambda: committed_steps(backup))
    time.sleep(random.uniform(0.0, 0.3))
    process.kill()  # SIGKILL
    process.wait()
    assert committed_steps(backup) and committed_steps(backup)[-1] < 52  # it died mid-run
    output = finish(backup, tmp_path / "out.npz", "--lora")
    assert re.search(r"resuming from step \d+", output), output
    assert_bit_identical(params(tmp_path / "out.npz"), reference)


def test_lora_on_an_nnx_module_trains_only_its_adapters_and_merges(tmp_path):
    from flax import nnx

    class NNXNet(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.body, self.head = nnx.Linear(5, 16, rngs=rngs), nnx.Linear(16, 3, rngs=rngs)

        def __call__(self, x):
            return self.head(nnx.relu(self.body(x)))

    x, y = make_classification(64)
    plain = tk.Trainer(
        NNXNet(nnx.Rngs(0)), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1),
        strategy=tk.FSDP(min_shard_size=1),
    )  # fmt: skip
    trainer = tk.Trainer(
        NNXNet(nnx.Rngs(0)), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2),
        strategy=tk.FSDP(min_shard_size=1), lora=tk.LoRA(rank=2, alpha=4.0),
    )  # fmt: skip
    np.testing.assert_allclose(trainer.predict(x), plain.predict(x), atol=1e-6)  # step 0: the base model
    before = trainer.get_weights()
    trainer.fit(x, y, batch_size=16, epochs=2, verbose=0)
    after = trainer.get_weights()
    changed = [
        n for n, a, b in zip(names(before), jax.tree.leaves(before), jax.tree.leaves(after)) if not np.array_equal(a, b)
    ]
    assert sorted(changed) == sorted(n for n in names(before) if "_lora_" in n) and len(changed) == 4
    merged = trainer.merge_lora()
    np.testing.assert_allclose(merged.predict(x), trainer.predict(x), atol=1e-5)
    assert sorted(merged.get_weights()["params"]["body"]) == ["bias", "kernel"]
    with pytest.raises(ValueError, match="quantize_base \\(QLoRA\\) works on flax.linen modules"):
        tk.Trainer(NNXNet(nnx.Rngs(0)), loss="mse", optimizer=optax.sgd(0.1), lora=tk.LoRA(quantize_base="nf4")).init(x)
