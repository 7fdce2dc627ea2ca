"""The ``compute_loss`` contract (#60): one loss per row (a scalar mean counted the padded rows),
padding that repeats real rows (zeros put NaN in a gradient), ``loss=`` never silently ignored,
sample weights applied once."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, make_classification
from flax import nnx

import trainkit as tk

X, Y = make_classification(200, features=5)  # batches of 64: the last one has 8 real rows and 56 padded


def cross_entropy(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


class MeanLoss(tk.Trainer):
    """The natural mistake: ``jnp.mean`` of the rows' losses."""

    def compute_loss(self, params, batch, rng, *, model_state, train):
        logits, model_state = self.apply(params, model_state, batch["x"], rng=rng, train=train)
        return jnp.mean(cross_entropy(logits, batch["y"])), (logits, model_state)


class RowLoss(tk.Trainer):
    def compute_loss(self, params, batch, rng, *, model_state, train):
        logits, model_state = self.apply(params, model_state, batch["x"], rng=rng, train=train)
        return cross_entropy(logits, batch["y"]), (logits, model_state)


def test_a_scalar_mean_loss_is_refused_before_the_first_step_naming_the_per_row_form():
    trainer = MeanLoss(MLP(), optimizer=optax.sgd(0.1), strategy="single")
    with pytest.raises(ValueError, match=r"The loss is a scalar: return one value per row \(shape \(64,\)\)"):
        trainer.fit(X, Y, batch_size=64, epochs=2, verbose=0)
    assert trainer.global_step == 0
    RowLoss(MLP(), optimizer=optax.sgd(0.1), strategy="single").fit(X, Y, batch_size=64, epochs=1, verbose=0)


def test_a_scalar_mean_metric_equals_the_per_row_one_exactly():
    """A metric returning the batch's mean read 0.1006 for 0.105: the padded rows counted. It is
    evaluated row by row now, so it equals the per-row metric and Keras's accuracy exactly."""

    def mean_accuracy(logits, y):
        return jnp.mean((jnp.argmax(logits, -1) == y).astype(jnp.float32))

    def row_accuracy(logits, y):
        return (jnp.argmax(logits, -1) == y).astype(jnp.float32)

    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1),
                         metrics=[mean_accuracy, row_accuracy, "accuracy"])  # fmt: skip
    logs = trainer.fit(X, Y, batch_size=64, epochs=2, verbose=0).history
    assert logs["mean_accuracy"] == logs["row_accuracy"] == logs["accuracy"], logs


class Normalised(nn.Module):
    """``x / ||x||``: undefined at an all-zero row, the rows zero padding used to make."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x / jnp.linalg.norm(x, axis=-1, keepdims=True))


def test_padding_repeats_real_rows_so_a_model_undefined_at_zero_trains_to_finite_weights():
    """With zero rows as padding the gradient of the last batch was NaN (the mask keeps the loss
    finite, not 0 * NaN in the gradient) and the weights went NaN in epoch 2."""
    trainer = tk.Trainer(Normalised(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-2))
    history = trainer.fit(X, Y, batch_size=64, epochs=2, verbose=0).history
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(trainer.params))
    assert np.isfinite(history["loss"]).all(), history


def test_the_normalising_model_trains_as_keras_trains_it_on_the_same_rows():
    """Keras runs the last partial batch as it is (8 rows); trainkit pads it with repeated rows it
    masks out: the same model and weights give Keras's losses and weights."""
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(0)
    normalise = keras.layers.Lambda(lambda x: x / keras.ops.norm(x, axis=-1, keepdims=True))
    model = keras.Sequential([keras.Input((5,)), normalise, keras.layers.Dense(3)])
    model.compile(
        optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    kernel, bias = model.get_weights()
    trainer = tk.Trainer(Normalised(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1),
                         params={"Dense_0": {"kernel": kernel, "bias": bias}})  # fmt: skip
    fit = {"batch_size": 64, "epochs": 2, "shuffle": False, "verbose": 0}
    theirs, ours = model.fit(X, Y, **fit).history, trainer.fit(X, Y, **fit).history
    np.testing.assert_allclose(ours["loss"], theirs["loss"], rtol=2e-5)
    np.testing.assert_allclose(trainer.params["Dense_0"]["kernel"], model.get_weights()[0], rtol=1e-4, atol=1e-6)


def test_loss_given_beside_a_compute_loss_that_never_uses_it_is_refused():
    with pytest.raises(ValueError, match=r"loss='mse' and loss_weights=0.5 given, but the trainer's compute_loss"):
        RowLoss(MLP(), loss="mse", loss_weights=0.5, optimizer=optax.sgd(0.1)).fit(X, Y, batch_size=64, verbose=0)

    class Extended(tk.Trainer):  # Keras's guide: the loss through super(), plus a term
        def compute_loss(self, params, batch, rng, *, model_state, train):
            loss, aux = super().compute_loss(params, batch, rng, model_state=model_state, train=train)
            return loss + 0.0 * jnp.sum(aux[0] ** 2, axis=-1), aux

    trained = Extended(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1))
    plain = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1))
    assert (trained.fit(X, Y, batch_size=64, epochs=1, verbose=0).history
            == plain.fit(X, Y, batch_size=64, epochs=1, verbose=0).history)  # fmt: skip


def test_a_compute_loss_that_applies_the_sample_weights_is_not_weighted_again():
    """Keras's guide weights inside compute_loss: ported as written, each weight counted twice
    (a logged loss of 3.83 for 2.81). Read there, trainkit applies them no more."""
    weights = np.random.default_rng(1).uniform(0.0, 3.0, len(X)).astype(np.float32)

    class Weighted(tk.Trainer):
        def compute_loss(self, params, batch, rng, *, model_state, train):
            logits, model_state = self.apply(params, model_state, batch["x"], rng=rng, train=train)
            return cross_entropy(logits, batch["y"]) * batch["sample_weight"], (logits, model_state)

    def fit(trainer):
        history = trainer.fit(X, Y, sample_weight=weights, batch_size=64, epochs=2, verbose=0,
                              validation_data=(X, Y, weights)).history  # fmt: skip
        return history, trainer.params

    ours, ours_params = fit(Weighted(MLP(), optimizer=optax.sgd(0.1)))
    builtin, builtin_params = fit(tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1)))
    np.testing.assert_allclose(ours["loss"], builtin["loss"], rtol=1e-6)
    np.testing.assert_allclose(ours["val_loss"], builtin["val_loss"], rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), ours_params, builtin_params)


class TwoOutputs(nn.Module):
    as_dict: bool = True

    @nn.compact
    def __call__(self, x):
        logits, features = nn.Dense(3)(x), nn.Dense(2)(x)
        return {"logits": logits, "features": features} if self.as_dict else (logits, features)


@pytest.mark.parametrize("as_dict, received", [(True, r"a dict of \['features', 'logits'\]"), (False, "a tuple of 2")])
def test_a_metric_by_name_on_several_outputs_names_the_fix(as_dict, received):
    """Once a raw "'dict' object has no attribute 'ndim'"."""

    class Logits(tk.Trainer):
        def compute_loss(self, params, batch, rng, *, model_state, train):
            out, model_state = self.apply(params, model_state, batch["x"], rng=rng, train=train)
            logits = out["logits"] if as_dict else out[0]
            return cross_entropy(logits, batch["y"]), (out, model_state)

    trainer = Logits(TwoOutputs(as_dict), optimizer=optax.sgd(0.1), metrics=["accuracy"])
    expected = rf"metrics=\['accuracy'\] reads one output, but the predictions are {received}: return the one it"
    with pytest.raises(ValueError, match=expected):
        trainer.fit(X, Y, batch_size=64, verbose=0)
    assert trainer.global_step == 0


class NoisyLinen(nn.Module):
    """A VAE's sampling: a stream of its own name."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(4)(x)
        return nn.Dense(3)(h + jax.random.normal(self.make_rng("noise"), h.shape) if train else h)


class NoisyNNX(nnx.Module):
    """The same with a stream ``nnx.Rngs`` names ``noise`` (``module.train()`` sets ``deterministic``)."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden, self.out = nnx.Linear(5, 4, rngs=rngs), nnx.Linear(4, 3, rngs=rngs)
        self.rngs, self.deterministic = rngs, True

    def __call__(self, x):
        h = self.hidden(x)
        return self.out(h if self.deterministic else h + jax.random.normal(self.rngs.noise(), h.shape))


@pytest.mark.parametrize("model", [NoisyLinen, lambda: NoisyNNX(nnx.Rngs(0, noise=1))], ids=["linen", "nnx"])
def test_a_stream_of_any_name_gets_a_key_from_the_step(model):
    """``make_rng("noise")`` failed: only a "dropout" stream was passed. Its draws come from the
    step's key: each step its own, the same again with the same seed."""

    def losses(seed):
        trainer = tk.Trainer(model(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.0), seed=seed)
        return trainer.fit(X, Y, batch_size=64, epochs=3, verbose=0, shuffle=False).history["loss"]

    first, again, other = losses(0), losses(0), losses(1)
    assert first == again and len(set(first)) == 3 and first != other, (first, again, other)


def test_set_weights_takes_what_get_weights_and_params_give_and_update_state_keeps_the_callers_arrays():
    """``set_weights(trainer.params)`` was a KeyError 'params'; ``b.update_state(params=a.state.params)``
    then training either trainer: "Array has been deleted" (the step donated the shared buffers)."""
    a = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), seed=1)
    b = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), seed=2)
    a.fit(X, Y, batch_size=64, epochs=1, verbose=0)
    b.init(X[:64])
    b.set_weights(a.params)
    jax.tree.map(np.testing.assert_array_equal, b.params, a.params)
    b.set_weights(a.get_weights())
    b.update_state(params=a.state.params)
    b.fit(X, Y, batch_size=64, epochs=1, verbose=0, shuffle=False)
    a.fit(X, Y, batch_size=64, epochs=1, verbose=0, shuffle=False)  # a's arrays were b's to donate no more
    jax.tree.map(np.testing.assert_array_equal, a.params, b.params)  # the same start, the same data
    with pytest.raises(ValueError, match=r"set_weights takes what get_weights gives .* or the parameters alone"):
        b.set_weights({"Dense_9": {}})


def test_grad_norm_in_the_epoch_logs_is_the_mean_of_its_steps():
    """It was the epoch's last step's value, beside logs that are epoch means."""

    def grad_norms(**fit):
        trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), seed=3,
                             log_grad_norm=True, steps_per_execution=1)  # fmt: skip
        return trainer.fit(X, Y, verbose=0, shuffle=False, **fit).history["grad_norm"]

    per_step = []
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), seed=3,
                         log_grad_norm=True, steps_per_execution=1)  # fmt: skip
    for start in range(0, 200, 64):  # the same four steps, one fit each
        rows = slice(start, start + 64)
        per_step += trainer.fit(X[rows], Y[rows], batch_size=64, verbose=0, shuffle=False).history["grad_norm"]
    np.testing.assert_allclose(grad_norms(batch_size=64), [np.mean(per_step)], rtol=1e-6)


def test_gradient_stats_in_the_epoch_logs_are_the_mean_of_the_epochs_measurements():
    stats = tk.callbacks.GradientStats(every=1)
    seen = []
    record = tk.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(logs["grad_norm"]))
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1),
                         steps_per_execution=1)  # fmt: skip
    history = trainer.fit(X, Y, batch_size=64, epochs=2, verbose=0, callbacks=[stats, record]).history
    np.testing.assert_allclose(history["grad_norm"], [np.mean(seen[:4]), np.mean(seen[4:])], rtol=1e-6)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"params": {"params": {"Dense_0": {"kernel": np.zeros((7, 3))}}}}, "params= does not match"),
        ({"trainable": "NoSuchLayer"}, "trainable='NoSuchLayer' matches none"),
        ({"optimizer": {"Dense_0": optax.sgd(0.1)}}, r"optimizer= is a dict of \['Dense_0'\]"),
    ],
)
def test_trainkits_own_refusals_are_not_blamed_on_the_model(options, message):
    """They read "The model raised ValueError when called on the first batch ...", with a hint
    about the model's inputs."""
    options = {"optimizer": optax.sgd(0.1), **options}
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", **options)
    with pytest.raises(ValueError, match=message) as raised:
        trainer.fit(X, Y, batch_size=64, verbose=0)
    assert "The model raised" not in str(raised.value)


class Normed(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.BatchNorm(use_running_average=not train)(nn.Dense(8)(x))
        return nn.Dense(3)(nn.Dropout(0.5, deterministic=not train)(x))


def _mistaken(mistake):
    class Mistaken(tk.Trainer):
        def compute_loss(self, params, batch, rng, *, model_state, train):
            if mistake == "live params":
                params = self.state.params
            flag = train or mistake == "train=True"
            logits, new_state = self.apply(params, model_state, batch["x"], rng=rng, train=flag)
            returned = model_state if mistake == "old model_state" else new_state
            return cross_entropy(logits, batch["y"]), (logits, returned)

    return Mistaken(Normed(), optimizer=optax.sgd(0.1))


@pytest.mark.parametrize(
    "mistake, message",
    [
        ("live params", r"compute_loss read trainer.state \(the live state\) while its step is traced"),
        ("old model_state", "compute_loss returned the model_state it was given, not the one self.apply"),
        ("train=True", r"compute_loss called self.apply\(..., train=True\) while the step evaluates"),
    ],
)
def test_state_mistakes_in_compute_loss_are_found_when_the_step_is_traced(mistake, message):
    """Each trained on something else without a word: a flat loss (nothing learns), BatchNorm's
    statistics frozen, dropout on in evaluate (0.845 for 0.970)."""
    trainer = _mistaken(mistake)
    with pytest.raises(ValueError, match=message):
        trainer.fit(X, Y, batch_size=64, epochs=1, verbose=0, validation_data=(X, Y))
    assert trainer.global_step == 0
    _mistaken(None).fit(X, Y, batch_size=64, epochs=1, verbose=0, validation_data=(X, Y))  # the right one trains


class InBatch(tk.Trainer):
    """A batch-level loss written in compute_loss: each row's loss against the batch's mean."""

    def compute_loss(self, params, batch, rng, *, model_state, train):
        logits, model_state = self.apply(params, model_state, batch["x"], rng=rng, train=train)
        centred = logits - jnp.mean(logits, axis=0, keepdims=True)
        return cross_entropy(centred, batch["y"]), (logits, model_state)


@pytest.mark.parametrize(
    "options, named",
    [({"strategy": "dp"}, "DataParallel gives it each device's rows"),
     ({"strategy": "single", "grad_accum_steps": 2}, "grad_accum_steps=2 gives it each micro-batch's rows")],
)  # fmt: skip
def test_an_in_batch_loss_is_refused_where_it_would_see_part_of_the_batch(options, named):
    """A contrastive loss read 1.11 under DataParallel against 2.88 on SingleDevice, and
    3.36/2.68/2.05 with accumulation 1/2/4, without a word."""
    trainer = InBatch(MLP(), optimizer=optax.sgd(0.1), **options)
    with pytest.raises(ValueError, match=rf"compute_loss mixes the rows of a batch .*, and {named}: it would"):
        trainer.fit(X, Y, batch_size=64, epochs=1, verbose=0)
    assert trainer.global_step == 0
    single = InBatch(MLP(), optimizer=optax.sgd(0.1), strategy="single").fit(X, Y, batch_size=64, verbose=0)
    fsdp = InBatch(MLP(), optimizer=optax.sgd(0.1), strategy="fsdp").fit(X, Y, batch_size=64, verbose=0)
    np.testing.assert_allclose(fsdp.history["loss"], single.history["loss"], rtol=1e-5)  # the whole batch on both
    RowLoss(MLP(), optimizer=optax.sgd(0.1), **options).fit(X, Y, batch_size=64, verbose=0)  # a per-row loss trains


class NormFeature(nn.Module):
    """A row's features and their norm: a zero row gives a finite loss and a NaN gradient (the
    square root's derivative at zero), the mistake a model meets on real data."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, use_bias=False)(x)
        return nn.Dense(3)(jnp.concatenate([h, jnp.sqrt(jnp.sum(h**2, -1, keepdims=True))], -1))


def _zero_row_at_batch_2():
    x, y = make_classification(64, features=5)
    x = x.copy()
    x[37] = 0.0  # batch 2 of 16 rows, step 3
    return x, y


@pytest.mark.parametrize("strategy", ["single", "dp"])
def test_a_nan_gradient_behind_a_finite_loss_is_named_at_its_own_step_with_the_norm_logged(strategy):
    x, y = _zero_row_at_batch_2()
    trainer = tk.Trainer(NormFeature(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1),
                         strategy=strategy, log_grad_norm=True)  # fmt: skip
    with pytest.warns(UserWarning, match=r"The gradient is not finite at step 3 \(batch 2 of epoch 0\), whose loss"):
        trainer.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    stopper = tk.callbacks.TerminateOnNaN()
    trainer = tk.Trainer(NormFeature(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1),
                         strategy=strategy, log_grad_norm=True)  # fmt: skip
    with pytest.warns(UserWarning, match=r"the gradient became nan \(its loss, [0-9.]+, is finite\) at batch 2"):
        trainer.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[stopper])
    assert stopper.stopped_step == 3 and trainer.global_step == 3


def test_without_the_norm_the_next_steps_loss_is_named_with_how_to_name_the_gradients_step():
    x, y = _zero_row_at_batch_2()
    trainer = tk.Trainer(NormFeature(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1))
    with pytest.warns(UserWarning, match=r"The loss is nan at step 4 \(batch 3 of epoch 0\).*log_grad_norm=True"):
        trainer.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
