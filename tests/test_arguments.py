"""``Trainer(...)`` and ``fit(...)``'s arguments as one frozen value each (program/arguments.py): Keras's
named in the signatures, trainkit's own as typed options; an unknown option refused by name before
anything is built; a trainer rebuilt from its value (``merge_lora``) keeps what it was made with."""

import dataclasses
import inspect
import typing

import flax.linen as nn
import numpy as np
import optax
import pytest

import trainkit as tk
from trainkit.program.arguments import FitArguments, FitOptions, TrainerArguments, TrainerOptions


def _parameters(function) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name not in ("self", "options")]


@pytest.mark.parametrize(
    ("function", "value", "options"),
    [(tk.Trainer.__init__, TrainerArguments, TrainerOptions), (tk.Trainer.fit, FitArguments, FitOptions)],
)
def test_the_value_holds_every_argument_and_option_with_the_signature_defaults(function, value, options):
    fields = {field.name: field for field in dataclasses.fields(value)}
    named = _parameters(function)
    assert list(fields) == named + list(typing.get_type_hints(options)), "a new argument is missing from the value"
    for name, parameter in inspect.signature(function).parameters.items():
        if name in fields and parameter.default is not inspect.Parameter.empty:
            assert fields[name].default == parameter.default, name
    kinds = {parameter.kind for parameter in inspect.signature(function).parameters.values()}
    assert inspect.Parameter.VAR_KEYWORD in kinds


def test_an_unknown_trainer_option_is_refused_by_name_with_the_nearest():
    with pytest.raises(TypeError, match=r"unknown option precison='bf16' \(did you mean precision\?\).*grad_accum"):
        tk.Trainer(nn.Dense(2), loss="mse", optimizer=optax.sgd(0.1), precison="bf16")
    with pytest.raises(TypeError, match=r"unknown option metric=\['accuracy'\] \(did you mean metrics\?\)"):
        tk.Trainer(nn.Dense(2), loss="mse", optimizer=optax.sgd(0.1), metric=["accuracy"])
    with pytest.raises(TypeError, match=r"unknown option xyzzy=1; its options"):
        tk.Trainer(nn.Dense(2), loss="mse", optimizer=optax.sgd(0.1), xyzzy=1)


def test_an_unknown_fit_option_is_refused_before_anything_runs():
    trainer = tk.Trainer(nn.Dense(2), loss="mse", optimizer=optax.sgd(0.1), strategy="single")
    x, y = np.ones((8, 3), np.float32), np.ones((8, 2), np.float32)
    with pytest.raises(TypeError, match=r"Trainer.fit got an unknown option max_step=3 \(did you mean max_steps\?\)"):
        trainer.fit(x, y, batch_size=4, max_step=3, verbose=0)
    assert trainer.state is None and trainer.global_step == 0  # nothing was built
    history = trainer.fit(x, y, batch_size=4, epochs=None, max_steps=3, verbose=0)  # the option, spelled right
    assert trainer.global_step == 3 and len(history.history["loss"]) == 2


def test_the_trainer_keeps_its_arguments_and_merge_lora_rebuilds_from_them():
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    y = (x.sum(axis=1) > 0).astype(np.int32)
    model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)])
    trainer = tk.Trainer(
        model,
        loss="sparse_categorical_crossentropy",
        optimizer=optax.adam(1e-2),
        strategy="single",
        seed=3,
        lora=tk.LoRA(rank=2),
        log_grad_norm=True,
        grad_accum_steps=2,
    )
    assert trainer.arguments.seed == 3 and trainer.arguments.grad_accum_steps == 2 and trainer.arguments.log_grad_norm
    with pytest.raises(dataclasses.FrozenInstanceError):
        trainer.arguments.seed = 4  # type: ignore[misc]
    trainer.fit(x, y, batch_size=8, epochs=1, verbose=0)
    merged = trainer.merge_lora()
    assert merged.arguments.lora is None and merged.arguments.trainable is None
    assert merged.arguments.grad_accum_steps == 2 and merged.arguments.log_grad_norm and merged.seed == 3
    np.testing.assert_allclose(merged.predict(x), trainer.predict(x), rtol=1e-5, atol=1e-5)
    history = merged.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert "grad_norm" in history.history  # the option it was made with, kept
