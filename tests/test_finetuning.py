"""Fine-tuning: frozen parameters (``Trainer(trainable=...)``) never change, carry no optimizer
state and train the same on every strategy."""

import jax
import numpy as np
import optax
import pytest
from conftest import MLP, make_classification

import trainkit as tk


def frozen_trainer(strategy="single", trainable=r"^Dense_1/", model=None):
    return tk.Trainer(
        model or MLP(),
        loss="sparse_categorical_crossentropy",
        optimizer=optax.adam(1e-2),
        strategy=strategy,
        trainable=trainable,
    )


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
