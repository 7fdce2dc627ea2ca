"""Settings that would do nothing, and Keras habits that would fail obscurely: each an error that
names the fix, or one warning that says what happened."""

import flax.linen as nn
import optax
import pytest
from conftest import MLP, classifier, make_classification

import trainkit as tk

X, Y = make_classification(n=64)


def trainer(model=None, **kwargs):
    return classifier(model, optimizer=optax.sgd(0.1), **kwargs)


def test_gradient_stats_per_layer_matching_no_module_is_refused_before_the_first_step():
    fitting = trainer()
    with pytest.raises(ValueError, match=r"per_layer='Conv'\) matches no module path.*Dense_0, Dense_1"):
        fitting.fit(X, Y, epochs=1, verbose=0, callbacks=[tk.callbacks.GradientStats(per_layer="Conv")])
    assert fitting.global_step == 0


def test_a_model_without_parameters_warns_that_nothing_trains():
    class Fixed(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x[:, :3] * 2.0

    with pytest.warns(UserWarning, match="The model has no parameters, so fit trains nothing"):
        trainer(Fixed()).fit(X, Y, epochs=1, verbose=0)


def test_lora_rank_at_least_a_kernel_s_side_and_a_quantised_base_of_nothing_warn():
    with pytest.warns(UserWarning, match=r"rank=8 is at least the smaller side of the kernels of Dense_0, Dense_1"):
        trainer(MLP(features=16, classes=3), lora=tk.LoRA(rank=8)).fit(X, Y, epochs=1, verbose=0)

    class NoDense(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Conv(3, (1,))(x[:, :, None]).mean(1)

    with pytest.warns(UserWarning, match=r"quantize_base='int8'\) quantised no kernel"):
        trainer(NoDense(), lora=tk.LoRA(rank=1, targets="Dense", quantize_base="int8"), trainable=".*").fit(
            X, Y, epochs=1, verbose=0
        )


def test_keras_habits_get_errors_that_name_the_fix():
    with pytest.raises(TypeError, match=r"skip_spikes takes a tk.SpikeSkip; received True"):
        trainer(skip_spikes=True)
    with pytest.raises(TypeError, match=r"received the class GradientStats, not a callback: instantiate it"):
        trainer().fit(X, Y, verbose=0, callbacks=[tk.callbacks.GradientStats])
    with pytest.raises(TypeError, match=r"callbacks takes a list.*callbacks=\[EarlyStopping\(...\)\]"):
        trainer().fit(X, Y, verbose=0, callbacks=tk.callbacks.EarlyStopping())
    history = trainer().fit(X, Y, epochs=1, verbose=0)
    with pytest.raises(KeyError, match=r"no bucket 'compilation': this fit's buckets are \[.*'compile'"):
        history.goodput.buckets["compilation"]


def test_a_train_flag_under_another_name_is_named():
    class Moded(nn.Module):
        @nn.compact
        def __call__(self, x, mode=False):
            return nn.Dense(3)(nn.Dropout(0.5, deterministic=not mode)(nn.Dense(8)(x)))

    with pytest.raises(ValueError, match=r"Dropout_0 \(Dropout\), switched by `mode`.*none of the flags trainkit sets"):
        trainer(Moded()).fit(X, Y, epochs=1, verbose=0)


def test_more_keras_habits_get_errors_that_name_the_fix():
    with pytest.raises(TypeError, match=r"A Trainer is compiled when made: tk.Trainer\(model, loss=..., optimizer="):
        trainer().compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match=r"received the targets twice.*Pass fit\(\(x, y\)\) or fit\(x, y\)"):
        trainer().fit((X, Y), Y, verbose=0)
    with pytest.raises(ValueError, match=r"y is a Python list of 64 values, not an array.*np.asarray\(y\)"):
        trainer().fit(X, list(Y), verbose=0)
