"""keras-io's custom-logic examples (a VAE, knowledge distillation) in Keras 3 (JAX backend) and
in trainkit, on the same digits in the same order from the same initial weights (and Keras's Adam
with optax's epsilon): trainkit reaches Keras's final figures (#58). Only the VAE's noise differs
(Keras's seed generator against trainkit's per-row draws)."""

import pathlib

import keras
import numpy as np
import optax
import pytest
from conftest import load_example

import trainkit as tk

ROOT = pathlib.Path(__file__).parent.parent
assert keras.backend.backend() == "jax"


vae, distillation = load_example("vae", "keras_example"), load_example("distillation", "keras_example")
EPOCHS = 15


def dense_pairs(layers):
    """``{"kernel": ..., "bias": ...}`` of Keras Dense layers, in order."""
    return [{"kernel": np.asarray(layer.kernel), "bias": np.asarray(layer.bias)} for layer in layers]


# ---------------------------------------------------------------------------------------------- the VAE
class Sampling(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        mean, log_var = inputs
        epsilon = keras.random.normal(keras.ops.shape(mean), seed=self.seed_generator)
        return mean + keras.ops.exp(0.5 * log_var) * epsilon


class KerasVAE(keras.Model):
    """keras-io's VAE (its loss in ``compute_loss``, the JAX backend's hook): the same layers as
    ``examples/vae.py``'s."""

    def __init__(self):
        super().__init__()
        self.hidden, self.mean = keras.layers.Dense(64, activation="relu"), keras.layers.Dense(2)
        self.log_var, self.sampling = keras.layers.Dense(2), Sampling()
        self.out_hidden, self.out = keras.layers.Dense(64, activation="relu"), keras.layers.Dense(64)

    def call(self, x, training=False):
        hidden = self.hidden(x)
        mean, log_var = self.mean(hidden), self.log_var(hidden)
        z = self.sampling([mean, log_var]) if training else mean
        return self.out(self.out_hidden(z)), mean, log_var

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        logits, mean, log_var = y_pred
        reconstruction = keras.ops.sum(
            keras.losses.binary_crossentropy(x[..., None], logits[..., None], from_logits=True), axis=-1
        )
        kl = -0.5 * keras.ops.sum(1 + log_var - mean**2 - keras.ops.exp(log_var), axis=-1)
        return keras.ops.mean(reconstruction + kl)


def test_the_vae_reaches_keras_figures():
    images = vae.digits()
    train, held_out = images[:1400], images[1400:]
    keras.utils.set_random_seed(0)
    model = KerasVAE()
    model(train[:2])
    hidden, mean, log_var, out_hidden, out = dense_pairs(
        [model.hidden, model.mean, model.log_var, model.out_hidden, model.out]
    )
    start = {"hidden": hidden, "mean": mean, "log_var": log_var, "out_hidden": out_hidden, "out": out}
    model.compile(optimizer=keras.optimizers.Adam(3e-3, epsilon=1e-8))
    keras_loss = model.fit(train, batch_size=64, epochs=EPOCHS, shuffle=False, verbose=0).history["loss"][-1]
    keras_held_out = model.evaluate(held_out, verbose=0)

    trainer = vae.VAETrainer(vae.VAE(), optimizer=optax.adam(3e-3), strategy="single", params=start)
    history = trainer.fit(train, batch_size=64, epochs=EPOCHS, shuffle=False, verbose=0).history
    held = trainer.evaluate(held_out, return_dict=True)
    assert history["loss"][-1] == pytest.approx(keras_loss, rel=0.05)
    assert held["loss"] == pytest.approx(keras_held_out, rel=0.05)
    assert history["reconstruction_loss"][-1] + history["kl_loss"][-1] == pytest.approx(history["loss"][-1], rel=1e-5)


# ---------------------------------------------------------------------------------------------- distillation
class KerasDistiller(keras.Model):
    """keras-io's ``Distiller`` (Keras 3: the loss in ``compute_loss``)."""

    def __init__(self, student, teacher, alpha, temperature):
        super().__init__()
        self.student, self.teacher, self.alpha, self.temperature = student, teacher, alpha, temperature

    def call(self, x):
        return self.student(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False, training=True):
        teacher_pred = self.teacher(x, training=False)
        student_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, y_pred)
        t = self.temperature
        distillation_loss = keras.losses.KLDivergence()(
            keras.ops.softmax(teacher_pred / t, axis=1), keras.ops.softmax(y_pred / t, axis=1)
        ) * (t**2)
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss


def test_distillation_reaches_keras_figures(tmp_path):
    (x, y), (held_x, held_y) = distillation.digits()
    distillation.train_teacher((x, y), 10, tmp_path / "teacher.safetensors", "single")
    trainer = distillation.make_distiller()
    trainer.init((x, y))
    tk.weights.load(tmp_path / "teacher.safetensors", into=trainer, prefix="teacher/")
    weights = trainer.get_weights()
    teacher, statistics = weights["params"]["teacher"], weights["batch_stats"]["teacher"]["BatchNorm_0"]

    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(256), keras.layers.BatchNormalization(epsilon=1e-5), keras.layers.ReLU()]
    keras_teacher = keras.Sequential([keras.Input((64,)), *layers, keras.layers.Dense(10)])
    norm = teacher["BatchNorm_0"]
    keras_teacher.set_weights([
        teacher["Dense_0"]["kernel"], teacher["Dense_0"]["bias"], norm["scale"], norm["bias"], statistics["mean"],
        statistics["var"], teacher["Dense_1"]["kernel"], teacher["Dense_1"]["bias"],
    ])  # fmt: skip
    np.testing.assert_allclose(
        keras_teacher.predict(held_x, verbose=0),
        np.asarray(trainer.apply(trainer.state.params, trainer.state.model_state, held_x, rng=trainer.state.rng,
                                 train=False, method="teach")[0]),
        atol=1e-4,
    )  # fmt: skip  # the same teacher on both sides
    keras_teacher.trainable = False  # as trainable=r"^student/" freezes it
    student = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)])
    (first, second) = dense_pairs(student.layers)
    model = KerasDistiller(student, keras_teacher, distillation.DistillationTrainer.alpha,
                           distillation.DistillationTrainer.temperature)  # fmt: skip
    model.compile(optimizer=keras.optimizers.Adam(1e-2, epsilon=1e-8), metrics=["sparse_categorical_accuracy"])
    keras_history = model.fit(x, y, batch_size=64, epochs=EPOCHS, shuffle=False, verbose=0).history
    keras_accuracy = model.evaluate(held_x, held_y, verbose=0, return_dict=True)["sparse_categorical_accuracy"]

    params = {**weights["params"], "student": {"Dense_0": first, "Dense_1": second}}
    trainer = distillation.make_distiller(params={"params": params, "batch_stats": weights["batch_stats"]})
    history = trainer.fit(x, y, batch_size=64, epochs=EPOCHS, shuffle=False, verbose=0).history
    accuracy = trainer.evaluate(held_x, held_y, return_dict=True)["accuracy"]
    assert history["loss"][-1] == pytest.approx(keras_history["loss"][-1], rel=0.05)
    assert accuracy == pytest.approx(keras_accuracy, rel=0.05)
