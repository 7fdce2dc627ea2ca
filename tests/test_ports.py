"""Ports, as a Keras or Flax user writes them, on the digits (in place of MNIST): Keras's "Simple
MNIST convnet" against Keras itself, Flax's ``examples/mnist`` training loop against its
hand-written loop on the same batches, and each row of docs/porting_from_keras.md against Keras
(the defaults that differ between Keras and Flax / optax)."""

import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import run_guide, tree_allclose

import trainkit as tk

keras = pytest.importorskip("keras")
datasets = pytest.importorskip("sklearn.datasets")

glorot = nn.initializers.glorot_uniform()


@pytest.fixture(scope="module")
def digits():
    loaded = datasets.load_digits()
    x = (loaded.images / 16.0).astype("float32")[..., None]
    order = np.random.default_rng(0).permutation(len(x))
    train, test = order[:1500], order[1500:]
    return x[train], loaded.target[train].astype("int32"), x[test], loaded.target[test].astype("int32")


# ---------------------------------------------------------------------- Keras's convnet
class ConvNet(nn.Module):
    """Keras's "Simple MNIST convnet" (one pooling layer fewer for 8x8 images), ported."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Conv(32, (3, 3), padding="VALID", kernel_init=glorot)(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Conv(64, (3, 3), padding="VALID", kernel_init=glorot)(x))
        x = nn.Dropout(0.5, deterministic=not train)(x.reshape((x.shape[0], -1)))
        return nn.Dense(10, kernel_init=glorot)(x)


def keras_convnet():
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
            layers.Flatten(),
            layers.Dropout(0.5),
            layers.Dense(10, activation="softmax"),
        ]
    )


def guide_port() -> dict:
    """docs/porting_from_keras.md's trainkit block, run as written (test_docs leaves it to this
    test): its namespace, holding the trainer it fit and the accuracy it evaluated."""
    page = pathlib.Path(__file__).parent.parent / "docs" / "porting_from_keras.md"
    return run_guide(page, first=1, where="tk.Trainer(")


def test_the_keras_convnet_port_learns_as_keras(digits):
    """The guide's port (the same split as ``digits``) against Keras's convnet."""
    x_train, y_train, x_test, y_test = digits
    one_hot = keras.utils.to_categorical
    keras.utils.set_random_seed(0)
    model = keras_convnet()
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    fit = {"batch_size": 128, "epochs": 15, "validation_split": 0.1, "verbose": 0}
    theirs = model.fit(x_train, one_hot(y_train, 10), **fit).history
    _, keras_accuracy = model.evaluate(x_test, one_hot(y_test, 10), verbose=0)
    port = guide_port()
    trainer, accuracy = port["trainer"], port["accuracy"]
    np.testing.assert_array_equal(port["x_test"], x_test)  # the guide's split is this test's
    ours = trainer.history.history
    assert trainer.count_params() == model.count_params()  # the same architecture, weight for weight
    assert sorted(ours) == sorted(theirs) and len(ours["loss"]) == len(theirs["loss"]) == 15
    assert accuracy > 0.9 and keras_accuracy > 0.9
    assert abs(accuracy - keras_accuracy) < 0.04, (accuracy, keras_accuracy)  # other seeds, same learning
    with pytest.raises(ValueError, match="look one-hot"):  # the habit of the other loss name
        tk.Trainer(ConvNet(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3)).fit(
            x_train, one_hot(y_train, 10).astype("int32"), epochs=1, verbose=0
        )


def test_a_kept_softmax_is_refused_and_the_loss_object_takes_it(digits):
    x_train, y_train, _, _ = digits

    class WithSoftmax(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.softmax(nn.Dense(10)(x.reshape((x.shape[0], -1))))

    with pytest.raises(ValueError, match=r"look like probabilities.*tk.losses.SparseCategoricalCrossentropy\(\)"):
        tk.Trainer(WithSoftmax(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3)).fit(
            x_train, y_train, epochs=1, verbose=0
        )
    trainer = tk.Trainer(WithSoftmax(), loss=tk.losses.SparseCategoricalCrossentropy(), optimizer=optax.adam(1e-2))
    history = trainer.fit(x_train, y_train, epochs=2, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0]


# ---------------------------------------------------------------------- Flax's mnist example
class FlaxCNN(nn.Module):
    """``flax/examples/mnist``'s model."""

    @nn.compact
    def __call__(self, x):
        x = nn.avg_pool(nn.relu(nn.Conv(32, (3, 3))(x)), (2, 2), strides=(2, 2))
        x = nn.avg_pool(nn.relu(nn.Conv(64, (3, 3))(x)), (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(256)(x.reshape((x.shape[0], -1))))
        return nn.Dense(10)(x)


def flax_example_batches(x, y, batch_size, epochs, seed=0):
    """``train_epoch``'s batches: a permutation per epoch, the incomplete last batch dropped."""
    rng, batches = jax.random.PRNGKey(seed), []
    steps = len(x) // batch_size
    for _ in range(epochs):
        rng, key = jax.random.split(rng)
        perms = np.asarray(jax.random.permutation(key, len(x)))[: steps * batch_size].reshape((steps, batch_size))
        batches.append([(x[p], y[p]) for p in perms])
    return batches


def test_the_flax_mnist_example_port_matches_its_hand_written_loop(digits):
    x_train, y_train, x_test, y_test = digits
    epochs, tx = 6, optax.sgd(0.1, momentum=0.9)
    batches = flax_example_batches(x_train, y_train, 128, epochs)
    model = FlaxCNN()
    params = model.init(jax.random.PRNGKey(1), jnp.ones((1, 8, 8, 1)))["params"]

    @jax.jit
    def apply_model_and_update(params, opt_state, images, labels):  # the example's train step
        def loss_fn(params):
            logits = model.apply({"params": params}, images)
            return optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, 10)).mean()

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    hand, opt_state, after_first_epoch = params, tx.init(params), None
    for epoch in batches:
        for images, labels in epoch:
            hand, opt_state = apply_model_and_update(hand, opt_state, images, labels)
        after_first_epoch = after_first_epoch or hand
    hand_accuracy = float(np.mean(np.argmax(model.apply({"params": hand}, x_test), -1) == y_test))

    trainer = tk.Trainer(
        FlaxCNN(),
        loss="sparse_categorical_crossentropy",  # the example's one-hot cross-entropy, on the labels
        optimizer=tx,
        metrics=["accuracy"],
        params=params,
        strategy="dp",  # on 8 devices: the same numbers up to the order of the sums
    )
    for index, epoch in enumerate(batches):  # the same batches, in the same order
        trainer.fit(epoch, epochs=1, verbose=0)
        if index == 0:  # 11 steps: float rounding only (later, lr 0.1 with momentum amplifies it)
            tree_allclose(trainer.params, after_first_epoch, rtol=1e-4, atol=1e-5)
    _, accuracy = trainer.evaluate(x_test, y_test)
    assert accuracy == pytest.approx(hand_accuracy, abs=3 / len(y_test)) and accuracy > 0.9, (accuracy, hand_accuracy)


# ---------------------------------------------------------------------- the table's rows
def test_conv_padding_valid_is_keras_s_default():
    keras_shape = keras.layers.Conv2D(4, 3).compute_output_shape((None, 28, 28, 1))
    x = jnp.zeros((1, 28, 28, 1))
    conv = lambda **kw: nn.Conv(4, (3, 3), **kw)  # noqa: E731
    shape = lambda layer: layer.apply(layer.init(jax.random.PRNGKey(0), x), x).shape  # noqa: E731
    assert shape(conv(padding="VALID"))[1:] == tuple(keras_shape[1:]) == (26, 26, 4)
    assert shape(conv())[1:] == (28, 28, 4)  # Flax's default, "SAME"


def test_pooling_strides_default_to_the_pool_size_in_keras_only():
    keras_shape = keras.layers.MaxPooling2D(2).compute_output_shape((None, 6, 6, 3))
    x = jnp.zeros((1, 6, 6, 3))
    assert nn.max_pool(x, (2, 2), strides=(2, 2)).shape[1:] == tuple(keras_shape[1:]) == (3, 3, 3)
    assert nn.max_pool(x, (2, 2)).shape[1:] == (5, 5, 3)


def test_glorot_uniform_is_keras_s_initial_scale():
    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense(256)
    dense.build((None, 512))
    keras_std = float(np.std(dense.kernel.numpy()))
    init = lambda **kw: nn.Dense(256, **kw).init(jax.random.PRNGKey(0), jnp.ones((1, 512)))  # noqa: E731
    std = lambda variables: float(np.std(variables["params"]["kernel"]))  # noqa: E731
    assert std(init(kernel_init=glorot)) == pytest.approx(keras_std, rel=0.03)
    lecun = (1 / 512) ** 0.5  # Flax's default, lecun_normal, against glorot's sqrt(2 / (512 + 256))
    assert std(init()) == pytest.approx(lecun, rel=0.03) and lecun < 0.9 * keras_std


class DropoutNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(1, use_bias=False)(nn.Dropout(0.5, deterministic=not train)(x))


class Recording(tk.Trainer):
    """Records the ``train`` flag each traced step gives the model."""

    def compute_loss(self, params, batch, rng, *, model_state, train):
        self.flags.append(train)
        return super().compute_loss(params, batch, rng, model_state=model_state, train=train)


def test_dropout_follows_the_train_argument_as_keras_s_training_flag():
    x, zeros = np.ones((64, 4), np.float32), np.zeros((64, 1), np.float32)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dropout(0.5), keras.layers.Dense(1, use_bias=False)])
    kernel = model.get_weights()[0]
    trainer = Recording(
        DropoutNet(), loss="mse", optimizer=optax.sgd(0.0), strategy="single", params={"Dense_0": {"kernel": kernel}}
    )
    trainer.flags = []
    np.testing.assert_allclose(trainer.predict(x), model.predict(x, verbose=0), rtol=1e-6)  # inference: no dropout
    trainer.fit(x, zeros, epochs=1, batch_size=64, verbose=0)
    assert set(trainer.flags) == {True}  # fit: dropout on
    trainer.flags.clear()
    trainer.evaluate(x, zeros)
    assert set(trainer.flags) == {False}  # evaluate: off, as Keras's training=False


def adam_steps(grad_value, steps=5):
    """Keras's Adam(1e-3) and optax's (eps=1e-7, and optax's default 1e-8) after ``steps``
    updates of one constant gradient, from 0."""
    grad = np.full(3, grad_value, np.float32)
    variable = keras.Variable(np.zeros(3, np.float32))
    keras_adam = keras.optimizers.Adam(1e-3)
    keras_adam.build([variable])
    for _ in range(steps):
        keras_adam.apply([grad], [variable])

    def optax_run(tx):
        params = jnp.zeros(3)
        state = tx.init(params)
        for _ in range(steps):
            updates, state = tx.update(jnp.asarray(grad), state, params)
            params = optax.apply_updates(params, updates)
        return float(params[0])

    return float(variable.numpy()[0]), optax_run(optax.adam(1e-3, eps=1e-7)), optax_run(optax.adam(1e-3))


def test_adam_epsilon_is_1e_7_in_keras_added_before_the_bias_correction():
    for grad in (1.0, 1e-2):  # ordinary gradients: eps=1e-7 reproduces Keras's steps
        keras_value, ported, default = adam_steps(grad)
        assert ported == pytest.approx(keras_value, rel=1e-3)
    keras_value, ported, default = adam_steps(1e-7)  # near epsilon: Keras's is the paper's epsilon-hat
    assert abs(keras_value) < 0.2 * abs(ported) < 0.2 * abs(default)  # scaled by 1/sqrt(1 - beta2^t) in optax's terms


def test_batch_norm_settings_give_keras_s_moving_statistics():
    rng = np.random.default_rng(0)
    x = rng.normal(2.0, 3.0, size=(32, 4)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization()])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    model.fit(x, x, batch_size=32, epochs=3, shuffle=False, verbose=0)

    class Norm(nn.Module):
        epsilon: float

        @nn.compact
        def __call__(self, x, train: bool = False):
            return nn.BatchNorm(use_running_average=not train, momentum=0.99, epsilon=self.epsilon)(x)

    def port(epsilon):
        trainer = tk.Trainer(Norm(epsilon), loss="mse", optimizer=optax.sgd(0.0), strategy="single")
        trainer.fit(x, x, batch_size=32, epochs=3, shuffle=False, verbose=0)
        return trainer

    ported = port(1e-3)
    stats = ported.get_weights()["batch_stats"]["BatchNorm_0"]
    bn = model.layers[0]
    np.testing.assert_allclose(stats["mean"], bn.moving_mean.numpy(), rtol=1e-5)
    np.testing.assert_allclose(stats["var"], bn.moving_variance.numpy(), rtol=1e-5)
    np.testing.assert_allclose(ported.predict(x), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    assert not np.allclose(port(1e-5).predict(x[:1] * 0), model.predict(x[:1] * 0, verbose=0), rtol=1e-7, atol=1e-7)


def test_layer_norm_epsilon_is_1e_3_in_keras_and_1e_6_in_flax():
    rng = np.random.default_rng(0)
    x = rng.normal(0.0, 0.03, size=(4, 16)).astype("float32")  # a small variance, where epsilon shows
    expected = np.asarray(keras.layers.LayerNormalization()(x))

    def flax_norm(**options):
        norm = nn.LayerNorm(**options)
        return np.asarray(norm.apply(norm.init(jax.random.PRNGKey(0), x), x))

    np.testing.assert_allclose(flax_norm(epsilon=1e-3), expected, rtol=1e-5, atol=1e-5)
    assert np.abs(flax_norm() - expected).max() > 0.1  # Flax's own 1e-6: other normalised values


def test_gelu_is_exact_in_keras_and_tanh_approximated_in_flax():
    x = np.linspace(-4.0, 4.0, 81).astype("float32")
    expected = np.asarray(keras.activations.gelu(x))  # Keras 3: approximate=False, also for activation="gelu"
    np.testing.assert_allclose(np.asarray(jax.nn.gelu(x, approximate=False)), expected, rtol=1e-6, atol=1e-7)
    assert np.abs(np.asarray(nn.gelu(x)) - expected).max() > 1e-4  # nn.gelu is jax.nn.gelu(approximate=True)


def test_every_row_of_the_porting_page_names_a_test_here():
    import pathlib

    page = (pathlib.Path(__file__).parent.parent / "docs" / "porting_from_keras.md").read_text()
    named = set(re.findall(r"\| `(test_\w+)` \|", page))
    assert len(named) >= 8 and named <= set(globals()), named - set(globals())
