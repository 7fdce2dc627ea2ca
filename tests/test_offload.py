"""``Trainer(offload="optimizer")``: the optimizer's state in host memory (``pinned_host``, which
JAX's CPU devices have too), streamed through each update a group of leaves at a time. It trains
on the bits of the same run without offload, under every strategy that can offload; checkpoints
move between the two; what cannot offload is refused before anything is built."""

import functools
import importlib.util
import re

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from conftest import Wide, classifier, make_classification, strategy_table

import trainkit as tk
from trainkit.core.offload import host_groups, streamed_update

X, Y = make_classification(128, features=64)
Y = Y % 8
STRATEGIES = strategy_table(min_shard_size=64)
OFFLOADING = [name for name in STRATEGIES if name != "dp8"]
trainer = functools.partial(classifier, Wide(), optimizer=optax.adamw(1e-3))


def trained(strategy, offload, steps_per_execution=1):
    run = trainer(strategy=strategy, offload=offload, steps_per_execution=steps_per_execution)
    history = run.fit(X, Y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    return run, history


#: jax 0.10's XLA:CPU compiles the streamed update to the bits of the whole one. jax 0.12's fuses
#: it differently on one device: floats then agree as strategies do (rtol 1e-5; ints and keys exactly).
EXACT = jax.__version_info__ < (0, 11)


def assert_same_bits(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for left, right in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        left, right = np.asarray(left), np.asarray(right)
        if not EXACT and np.issubdtype(left.dtype, np.floating):
            np.testing.assert_allclose(left, right, rtol=1e-5, atol=1e-7)
        else:
            np.testing.assert_array_equal(left, right)


def host_kinds(state):
    return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim}


@pytest.mark.parametrize(("name", "steps_per_execution"), [*((n, 1) for n in OFFLOADING), ("fsdp8", 4)])
def test_offload_trains_on_the_bits_of_the_run_without_it(name, steps_per_execution):
    offloaded, history = trained(STRATEGIES[name](), "optimizer", steps_per_execution)
    reference, reference_history = trained(STRATEGIES[name](), None, steps_per_execution)
    assert host_kinds(offloaded.state) == {"pinned_host"}  # every moment: none came back to the device
    assert host_kinds(reference.state) == {"device"}
    assert_same_bits(offloaded.state, reference.state)
    assert_same_bits(history.history, reference_history.history)


def test_each_group_holds_what_one_update_reads():
    params = {"a": np.ones((4, 3), np.float32), "b": np.ones(4, np.float32)}
    grads = jax.tree.map(lambda p: np.full_like(p, 0.5), params)
    adam = optax.adam(0.1)
    groups = host_groups(adam, grads, adam.init(params), params)
    assert [sorted(name.split(".")[-1] for name in group) for group in groups] == [
        ["mu['a']", "nu['a']"],
        ["mu['b']", "nu['b']"],
    ]
    # clipping after Adam's scaling reads every moment for every parameter: one group, streamed exactly
    clipped = optax.chain(optax.scale_by_adam(), optax.clip_by_global_norm(0.01), optax.scale(-0.1))
    state = clipped.init(params)
    assert [len(group) for group in host_groups(clipped, grads, state, params)] == [4]
    streamed = jax.jit(functools.partial(streamed_update, clipped))(grads, state, params)
    assert_same_bits(streamed, jax.jit(clipped.update)(grads, state, params))


@pytest.mark.parametrize(("offload", "frozen"), [("optimizer", {}), ("optimizer+frozen", {"trainable": "Dense_2"})])
def test_a_checkpoint_moves_between_offloaded_and_not(tmp_path, offload, frozen):
    offloaded = trainer(strategy=STRATEGIES["fsdp8"](), offload=offload, **frozen)
    offloaded.fit(X, Y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    offloaded.save(tmp_path / "ckpt")
    plain = trainer(strategy=STRATEGIES["fsdp8"](), **frozen)
    plain.init(X[:32])
    plain.load(tmp_path / "ckpt")
    assert host_kinds(plain.state) == {"device"}
    assert_same_bits(plain.state, offloaded.state)
    for run in (offloaded, plain):
        run.fit(X, Y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    assert_same_bits(plain.state, offloaded.state)
    back = trainer(strategy="single", offload=offload, **frozen)
    back.init(X[:32])
    back.load(tmp_path / "ckpt")
    assert host_kinds(back.state) == {"pinned_host"}
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(back.state.params)}
    assert kinds == ({"device", "pinned_host"} if frozen else {"device"})


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"strategy": "dp"}, "DataParallel cannot keep the optimizer's state in host memory"),
        ({"run_eagerly": True}, "run_eagerly=True compiles nothing"),
        ({"precision": "fp16"}, "loss scaling ('dynamic') is not supported"),
        ({"skip_spikes": tk.SpikeSkip()}, "with skip_spikes is not supported"),
    ],
    ids=["data_parallel", "eager", "fp16", "skip_spikes"],
)
def test_what_cannot_offload_is_refused_when_the_trainer_is_made(options, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        trainer(offload="optimizer", **{"strategy": "single", **options})


def test_an_unknown_offload_is_refused_with_the_settings():
    with pytest.raises(ValueError, match="offload='cpu' is not a setting. Use offload='optimizer' .*, 'auto'"):
        trainer(offload="cpu")


def test_auto_leaves_data_parallel_out_under_offload_and_says_why():
    plan = trainer(offload="optimizer", strategy="auto").plan((X, Y), batch_size=32, verbose=0)
    rows = {type(row.strategy).__name__: row for row in plan.rows}
    assert rows["DataParallel"].left_out and "cannot keep the optimizer's state" in rows["DataParallel"].error
    assert plan.recommended is not None and plan.recommended.strategy.offload


@pytest.mark.parametrize(
    ("name", "frozen"),
    [("fsdp8", {"lora": tk.LoRA(rank=2)}), ("single", {"trainable": "Dense_2", "steps_per_execution": 4})],
    ids=["lora_fsdp", "trainable_single_fused"],
)
def test_offloaded_frozen_parameters_stay_on_the_host_and_train_on_the_bits_of_the_run_without(name, frozen):
    offloaded = trainer(strategy=STRATEGIES[name](), offload="optimizer+frozen", **frozen)
    history = offloaded.fit(X, Y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    reference = trainer(strategy=STRATEGIES[name](), **frozen)
    reference_history = reference.fit(X, Y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    trains = offloaded.program.trainable.mask(offloaded.state.params)
    kinds = jax.tree.map(lambda leaf, train: (train, leaf.sharding.memory_kind), offloaded.state.params, trains)
    assert set(jax.tree.leaves(kinds, is_leaf=lambda k: isinstance(k, tuple))) == {
        (True, "device"),
        (False, "pinned_host"),
    }
    assert_same_bits(offloaded.state, reference.state)
    assert_same_bits(history.history, reference_history.history)
    assert_same_bits(offloaded.evaluate(X, Y), reference.evaluate(X, Y))
    assert_same_bits(offloaded.predict(X), reference.predict(X))


@pytest.mark.parametrize("name", ["single", "fsdp8"])
def test_offloaded_frozen_parameters_work_after_init_as_the_docs_write_it(name):
    """#59: after trainer.init(...) (then load the base, then fit), every fit, evaluate and predict
    failed with "memory_space of all inputs passed to dot_general must be the same"."""
    offloaded = trainer(strategy=STRATEGIES[name](), offload="optimizer+frozen", trainable="Dense_2")
    reference = trainer(strategy=STRATEGIES[name](), trainable="Dense_2")
    for made in (offloaded, reference):
        made.init((X, Y))
    assert_same_bits(
        offloaded.fit(X, Y, batch_size=32, verbose=0, shuffle=False).history,
        reference.fit(X, Y, batch_size=32, verbose=0, shuffle=False).history,
    )
    assert_same_bits(offloaded.evaluate(X, Y), reference.evaluate(X, Y))
    assert_same_bits(offloaded.predict(X), reference.predict(X))


def test_offloading_frozen_parameters_when_none_is_frozen_is_refused():
    with pytest.raises(ValueError, match=r"'optimizer\+frozen' keeps the frozen parameters .* but none is frozen"):
        trainer(offload="optimizer+frozen")


def test_offload_auto_under_a_given_strategy_is_planned_at_the_first_fit_and_added_only_if_it_must_be():
    decides = trainer(strategy="fsdp", offload="auto")
    assert decides.strategy is None  # settled by the plan at the first fit, as under "auto"
    assert [rung.name for rung in decides.setup.ladder(X[:8])] == ["optimizer offload"]  # only offload to add
    history = decides.fit(X, Y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    assert tk.plan.short_name(decides.strategy) == "FSDP(fsdp=8)" and not decides.strategy.offload  # it fits as it is
    assert host_kinds(decides.state) == {"device"}
    reference, reference_history = trained(STRATEGIES["fsdp8"](), None)
    assert_same_bits(decides.state, reference.state)
    assert_same_bits(history.history, reference_history.history)
    kept = trainer(strategy="dp", offload="auto")  # cannot offload: trains as given, nothing planned
    assert kept.strategy is not None and tk.plan.short_name(kept.strategy) == "DataParallel(data=8)"


class Blocks(nn.Module):
    """Transformer-shaped blocks of dense layers (attention's w x 3w and w x w, the MLP's w x 4w
    and 4w x w: 12 w^2 parameters per layer, as a GPT block), without the attention itself."""

    width: int
    layers: int

    @nn.compact
    def __call__(self, x):
        w = self.width
        x = nn.Dense(w)(x)
        for _ in range(self.layers):
            x = x + nn.Dense(w)(nn.tanh(nn.Dense(3 * w)(x)[..., :w]))
            x = x + nn.Dense(w)(nn.relu(nn.Dense(4 * w)(x)))
        return nn.Dense(8)(x)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="the tpu-plan extra is not installed")
def test_on_a_v5e_slice_offload_fits_what_adams_state_does_not():
    """Compiled for a 2x2 v5e slice (16 GiB a chip), never run: the moments leave the device's
    arguments for host memory, the compiler's temporaries grow by less than one layer's moments,
    and 5.6 billion parameters that FSDP alone cannot hold fit: the plan adds offload itself."""
    width, devices = 8192, 4
    x, y = np.zeros((8, width), np.float32), np.zeros(8, np.int32)

    def plan(layers, offload):
        model = classifier(Blocks(width, layers), optimizer=optax.adamw(1e-3), offload=offload)
        return model.plan((x, y), target="tpu v5e:2x2", candidates=["fsdp"], verbose=0)

    plain = plan(3, None)  # 2.4 B parameters: three blocks compile sooner than more
    (before,), (after,) = plain.rows, plan(3, "optimizer").rows
    moments = plain.state_bytes["optimizer state"] / devices  # per device
    layer_moments = 2 * 12 * width**2 * 4 / devices
    assert before.fits and after.fits and after.host_bytes == pytest.approx(moments, rel=0.01)
    assert before.argument_bytes - after.argument_bytes >= 0.9 * moments
    assert after.temp_bytes - before.temp_bytes < layer_moments, (after.temp_bytes, before.temp_bytes)
    climbed = plan(7, None)  # FSDP alone cannot hold 5.6 B parameters: the plan adds what makes them fit
    alone, offloaded = climbed.rows[0], climbed.recommended
    assert not alone.fits and "the state alone needs" in (alone.error or ""), alone.error
    assert [row.name for row in climbed.rows] == ["FSDP(fsdp=4)", "FSDP(fsdp=4) + remat", "FSDP(fsdp=4) + offload"]
    assert offloaded.name == "FSDP(fsdp=4) + offload" and offloaded.total_bytes < 0.5 * 16 * 2**30
    assert "picked FSDP(fsdp=4) + offload (added optimizer offload: no candidate fit without it)" in climbed.reason()


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="the tpu-plan extra is not installed")
def test_on_a_v5e_slice_a_frozen_base_larger_than_a_chip_streams_through_it():
    """Compiled for a 2x2 v5e slice, never run: 38.6 billion frozen bf16 parameters (18 GiB a
    chip) and a trainable head. Without offload the state alone is above the chip; with the
    frozen parameters offloaded the step compiles, and the compiler moves them in layer by
    layer (it prefetches as far as the memory allows): never all of them at once."""
    width, layers, devices = 16384, 12, 4
    x, y = np.zeros((8, width), np.float32), np.zeros(8, np.int32)
    bf16 = tk.Precision(param_dtype="bfloat16", compute_dtype="bfloat16")

    def plan(offload):
        model = classifier(
            Blocks(width, layers), optimizer=optax.adamw(1e-3), offload=offload, precision=bf16,
            trainable=f"Dense_{4 * layers + 1}",
        )  # fmt: skip
        return model.plan((x, y), target="tpu v5e:2x2", candidates=["fsdp"], verbose=0, add_measures=False).rows[0]

    frozen, layer = 12 * layers * width**2 * 2 / devices, 12 * width**2 * 2 / devices  # bytes per chip
    alone = plan(None)
    assert not alone.fits and "the state alone needs" in (alone.error or ""), alone.error
    streamed = plan("optimizer+frozen")
    assert streamed.error is None and streamed.host_bytes == pytest.approx(frozen, rel=0.01)
    assert streamed.argument_bytes < 0.01 * frozen  # nothing of the base is an argument in device memory
    assert streamed.temp_bytes < min(frozen - layer, 16 * 2**30), (streamed.temp_bytes, frozen)  # a chip's HBM
