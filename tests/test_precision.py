"""Precision policy: bf16 and fp16 mixed training, loss scaling, dtypes inside the step."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, make_classification
from sklearn.datasets import load_digits

import trainkit as tk
from trainkit.core.step import make_train_step


class SmallCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.avg_pool(nn.relu(nn.Conv(16, (3, 3))(x)), (2, 2), strides=(2, 2))
        return nn.Dense(10)(nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1))))


def test_bf16_reaches_the_accuracy_of_fp32_on_a_small_cnn():
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    accuracy = {}
    for precision in ("fp32", "bf16"):
        trainer = tk.Trainer(
            SmallCNN(),
            loss="sparse_categorical_crossentropy",
            optimizer=optax.adam(3e-3),
            metrics=["accuracy"],
            strategy="single",
            precision=precision,
        )
        trainer.fit((x[:1400], y[:1400]), epochs=10, batch_size=64, verbose=0)
        accuracy[precision] = trainer.evaluate((x[1400:], y[1400:]), return_dict=True)["accuracy"]
        assert jax.tree.leaves(trainer.state.params)[0].dtype == jnp.float32  # master weights
    assert accuracy["fp32"] > 0.9
    assert accuracy["bf16"] >= accuracy["fp32"] - 0.03


def _dot_dtypes(jaxpr):
    """Input dtypes of every matrix product / convolution in a jaxpr, sub-jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
            found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(item, "jaxpr", item)  # ClosedJaxpr -> Jaxpr
                if hasattr(inner, "eqns"):
                    found += _dot_dtypes(inner)
    return found


class OwnDtype(nn.Module):
    """The first layer follows the policy; the output layer insists on float32."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, dtype=jnp.float32)(nn.relu(nn.Dense(8)(x)))


def test_dtypes_inside_the_compiled_step():
    x, y = make_classification(16)
    trainer = tk.Trainer(
        OwnDtype(),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.sgd(0.1),
        strategy="single",
        precision="bf16",
    )
    state = trainer.init(x)
    batch = {"x": x, "y": y, "mask": np.ones(16, np.float32)}
    step = make_train_step(trainer.compute_loss, trainer.optimizer, {})
    closed = jax.make_jaxpr(step)(state, batch)
    dots = _dot_dtypes(closed.jaxpr)
    assert ("float32", "float32") in dots  # the module's own dtype is respected
    assert ("bfloat16", "bfloat16") in dots  # the rest computes in bfloat16
    new_state, metrics = jax.eval_shape(step, state, batch)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(new_state.params))
    assert metrics["loss"].total.dtype == jnp.float32  # loss in float32
    fp32 = tk.Trainer(OwnDtype(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single")
    fp32_dots = _dot_dtypes(
        jax.make_jaxpr(make_train_step(fp32.compute_loss, fp32.optimizer, {}))(fp32.init(x), batch).jaxpr
    )
    assert all(d == ("float32", "float32") for d in fp32_dots)


@pytest.mark.parametrize("strategy", ["single", "data_parallel"])
def test_fp16_skips_an_overflowing_step_and_lowers_the_scale(strategy):
    x, y = make_classification(64)
    trainer = tk.Trainer(
        MLP(),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.adam(1e-2),
        strategy=strategy,
        precision=tk.Precision(compute_dtype=jnp.float16, loss_scale="dynamic", growth_interval=3),
    )
    trainer.fit((x, y), epochs=1, batch_size=16, shuffle=False, verbose=0)  # 4 finite steps
    scale = float(trainer.state.loss_scale.loss_scale)
    assert scale == 2.0**16  # grew once after 3 good steps
    before = trainer.get_weights()
    huge = np.full_like(x[:16], 6e4)  # float16 overflows (max 65504) in the first layer
    history = trainer.fit((huge, y[:16]), epochs=1, batch_size=16, verbose=0)
    assert float(trainer.state.loss_scale.loss_scale) == scale / 2
    assert int(trainer.state.step) == 5
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(trainer.get_weights())):
        np.testing.assert_array_equal(a, b)  # the update was skipped
    assert np.isnan(history.history["loss"][0])  # a skipped step is not an observation
    assert history.history["loss_scale"][0] == scale / 2
    history = trainer.fit((x, y), epochs=3, batch_size=16, verbose=0)  # and training goes on
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_precision_names_and_errors():
    assert (
        tk.Trainer(
            MLP(), loss="mse", optimizer=optax.sgd(0.1), precision="mixed_float16", strategy="dp"
        ).precision.loss_scale
        == "dynamic"
    )
    with pytest.raises(ValueError, match=r"Unknown precision 'half'. Known names: fp32.*bf16"):
        tk.Trainer(MLP(), loss="mse", optimizer=optax.sgd(0.1), precision="half", strategy="dp")
    with pytest.raises(ValueError, match="must be a floating dtype; received int32"):
        tk.Precision(compute_dtype=jnp.int32)


def test_bf16_params_when_asked():
    x, y = make_classification(16)
    trainer = tk.Trainer(
        MLP(),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.sgd(0.1),
        precision=tk.Precision(param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16),
        strategy="dp",
    )
    trainer.fit((x, y), batch_size=16, verbose=0)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(trainer.state.params))


def test_loss_scale_objects_share_one_interface():
    from trainkit.core.precision import DynamicLossScale, NoLossScale, StaticLossScale

    grads = {"w": jnp.array([1.0, jnp.inf])}
    new, old = {"w": jnp.ones(2)}, {"w": jnp.zeros(2)}
    none = NoLossScale()
    assert none.scale(jnp.array(3.0)) == 3.0 and none.unscale(grads) is grads
    assert none.guard(grads, new, old) == (new, none) and none.metrics() == {}
    static = StaticLossScale(jnp.array(8.0, jnp.float32))
    assert float(static.scale(jnp.array(3.0))) == 24.0
    assert float(static.unscale({"w": jnp.array(8.0)})["w"]) == 1.0
    chosen, after = static.guard(grads, new, old)
    assert chosen["w"].tolist() == [0.0, 0.0] and after is static  # skipped; a static scale stays
    dynamic = DynamicLossScale(jnp.array(8.0, jnp.float32), jnp.zeros((), jnp.int32), growth_interval=2)
    chosen, after = dynamic.guard(grads, new, old)
    assert chosen["w"].tolist() == [0.0, 0.0] and float(after.loss_scale) == 4.0
    chosen, after = after.guard({"w": jnp.ones(2)}, new, old)
    assert chosen["w"].tolist() == [1.0, 1.0] and float(after.loss_scale) == 4.0 and int(after.good_steps) == 1


def test_a_static_loss_scale_trains_in_fp16_and_skips_overflows():
    x, y = make_classification(64)
    trainer = tk.Trainer(
        MLP(),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.adam(1e-2),
        strategy="single",
        precision=tk.Precision(compute_dtype=jnp.float16, loss_scale=128.0),
    )
    history = trainer.fit((x, y), epochs=3, batch_size=16, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert history.history["loss_scale"] == [128.0, 128.0, 128.0]
    before = trainer.get_weights()
    trainer.fit((np.full_like(x[:16], 6e4), y[:16]), epochs=1, batch_size=16, verbose=0)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(trainer.get_weights())):
        np.testing.assert_array_equal(a, b)


def test_fp16_warns_when_every_step_is_skipped():
    from trainkit.loop import SKIPPED_WARNING

    x, y = make_classification(64)
    trainer = tk.Trainer(
        MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2), strategy="single", precision="fp16"
    )
    huge = np.full((16 * SKIPPED_WARNING, x.shape[1]), 6e4, np.float32)  # every step overflows
    labels = np.resize(y, len(huge))
    with pytest.warns(UserWarning, match=rf"The last {SKIPPED_WARNING} steps .* were all skipped.*precision='bf16'"):
        trainer.fit((huge, labels), epochs=1, batch_size=16, verbose=0)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # finite steps: no warning
        trainer.fit((x, y), epochs=1, batch_size=16, verbose=0)
