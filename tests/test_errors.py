"""Bad input gets a clear error before anything compiles."""

import numpy as np
import optax
import pytest
from conftest import MLP, classifier, make_classification

import trainkit as tk


@pytest.fixture
def trainer():
    return classifier(optimizer=optax.sgd(0.1), strategy=tk.DataParallel())


@pytest.fixture
def no_compile(monkeypatch, trainer):
    """Fails the test if the trainer compiles a step."""

    def refuse(kind, strategy, abstract_state):
        raise AssertionError(f"compiled {kind} before rejecting bad input")

    monkeypatch.setattr(trainer.program, "compile", refuse)
    return trainer


def test_mismatched_lengths(no_compile):
    x, y = make_classification(10)
    with pytest.raises(ValueError, match=r"different numbers of rows \(x: 10 rows, y: 9 rows\)"):
        no_compile.fit((x, y[:9]), verbose=0)


def test_feature_shape_differs_from_initialisation(trainer, monkeypatch):
    x, y = make_classification(16)
    trainer.init(x)
    monkeypatch.setattr(trainer.program, "compile", lambda *args: pytest.fail("compiled"))
    with pytest.raises(ValueError, match=r"per-example shape \(7,\).*initialised with per-example shape \(5,\)"):
        trainer.fit((np.ones((16, 7), np.float32), y), batch_size=8, verbose=0)
    with pytest.raises(ValueError, match="per-example shape"):
        trainer.predict(np.ones((4, 7), np.float32), batch_size=8)


@pytest.mark.parametrize("empty", [(np.zeros((0, 5), np.float32), np.zeros(0, np.int32)), []])
def test_empty_dataset(no_compile, empty):
    with pytest.raises(ValueError, match="empty"):
        no_compile.fit(empty, verbose=0)


@pytest.mark.parametrize("loss", ["sparse_categorical_crossentropy", optax.softmax_cross_entropy_with_integer_labels])
def test_float_labels_for_sparse_loss(loss):
    trainer = tk.Trainer(MLP(), loss=loss, optimizer=optax.sgd(0.1), strategy="dp")
    x, y = make_classification(16)
    with pytest.raises(ValueError, match=r"integer class ids.*dtype float32.*astype"):
        trainer.fit((x, y.astype(np.float32)), batch_size=8, verbose=0)
    assert trainer.state is None  # rejected before even initialising


def test_unknown_loss_lists_known_names():
    with pytest.raises(ValueError, match=r"Unknown loss 'cross_entropy'.*sparse_categorical_crossentropy"):
        tk.Trainer(MLP(), loss="cross_entropy", optimizer=optax.sgd(0.1), strategy="dp")


def test_unknown_metric_lists_known_names():
    with pytest.raises(ValueError, match=r"Unknown metric 'f1'.*accuracy.*top_k_accuracy"):
        tk.Trainer(MLP(), loss="mse", optimizer=optax.sgd(0.1), metrics=["f1"], strategy="dp")


@pytest.mark.parametrize("epochs", [-1, 1.5, "3"])
def test_bad_epochs(no_compile, epochs):
    x, y = make_classification(16)
    with pytest.raises(ValueError, match=f"epochs must be a non-negative integer; received epochs={epochs!r}"):
        no_compile.fit((x, y), epochs=epochs, verbose=0)


@pytest.mark.parametrize("model", [lambda x: x, "MLP", object()])
def test_non_flax_model(model):
    with pytest.raises(TypeError, match="needs a Flax module; received an object of type"):
        tk.Trainer(model, loss="mse", optimizer=optax.sgd(0.1), strategy="dp")


def test_batch_size_devices_cannot_split(no_compile):
    x, y = make_classification(100)
    with pytest.raises(ValueError, match=r"batch_size=30 cannot be split evenly across 8 devices.*24 or 32"):
        no_compile.fit((x, y), batch_size=30, verbose=0)
    with pytest.raises(ValueError, match=r"batch_size=5 .* 8 devices.*nearest valid sizes are 8"):
        no_compile.evaluate((x, y), batch_size=5)


def test_iterable_batches_devices_cannot_split(no_compile):
    x, y = make_classification(30)
    batches = [(x[i : i + 10], y[i : i + 10]) for i in range(0, 30, 10)]
    with pytest.raises(ValueError, match="batch_size=10 cannot be split evenly across 8 devices"):
        no_compile.fit(batches, verbose=0)


def test_not_an_optimizer():
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        tk.Trainer(MLP(), loss="mse", optimizer="adam", strategy="dp")


def test_missing_targets(no_compile):
    x, _ = make_classification(16)
    with pytest.raises(ValueError, match="no targets"):
        no_compile.fit(x, verbose=0)


def test_unknown_strategy():
    with pytest.raises(ValueError, match="Unknown strategy 'fsdp_typo'"):
        tk.Trainer(MLP(), loss="mse", optimizer=optax.sgd(0.1), strategy="fsdp_typo")


def test_fine_tuning_variables_that_do_not_match():
    x, _ = make_classification(4)
    wrong = {"params": {"Dense_0": {"kernel": np.zeros((5, 16)), "bias": np.zeros(16)}}}
    trainer = tk.Trainer(MLP(), loss="mse", optimizer=optax.sgd(0.1), params=wrong, strategy="dp")
    with pytest.raises(ValueError, match=r"params= does not match.*Dense_1.*not in the variables given"):
        trainer.init(x)


def test_state_needed_before_params():
    trainer = tk.Trainer(MLP(), loss="mse", optimizer=optax.sgd(0.1), strategy="dp")
    with pytest.raises(RuntimeError, match="call fit"):
        trainer.params  # noqa: B018


@pytest.mark.parametrize("value", ["10s", "0", "-5", "inf", "ten"])
def test_a_timeout_setting_that_is_not_seconds_names_the_variable(value, monkeypatch):
    from trainkit.distributed import environment
    from trainkit.distributed.watchdog import StallWatchdog

    monkeypatch.setenv("TRAINKIT_STALL_TIMEOUT", value)
    with pytest.raises(ValueError, match=rf"TRAINKIT_STALL_TIMEOUT='{value}' is not a number of seconds"):
        StallWatchdog()  # what every fit builds: the run stops at its start, naming the variable
    monkeypatch.setenv("TRAINKIT_GATHER_TIMEOUT", value)
    with pytest.raises(ValueError, match="TRAINKIT_GATHER_TIMEOUT=.*e.g. TRAINKIT_GATHER_TIMEOUT=60"):
        environment.seconds("TRAINKIT_GATHER_TIMEOUT", 60)
    monkeypatch.setenv("TRAINKIT_STALL_TIMEOUT", " 6.5 ")
    assert StallWatchdog().timeout == 6.5
