"""docs/custom_strategy.md: the user subclass on that page works and matches SingleDevice."""

import pathlib

import optax
import pytest
from conftest import MLP, make_classification, run_guide, tree_allclose

import trainkit as tk

DOC = pathlib.Path(__file__).parent.parent / "docs" / "custom_strategy.md"


def run_doc():
    return run_guide(DOC)


def test_documented_custom_strategy_matches_single_device():
    namespace = run_doc()
    assert namespace["trainer"].state is not None  # the page's own example ran
    x, y = make_classification(100)  # 100 rows, batch 16: a ragged last batch
    params, evals = [], []
    for strategy in (namespace["JitDataParallel"](), tk.SingleDevice()):
        trainer = tk.Trainer(
            MLP(),
            loss="sparse_categorical_crossentropy",
            optimizer=optax.adam(0.01),
            metrics=["accuracy"],
            strategy=strategy,
            seed=2,
        )
        trainer.fit((x, y), batch_size=16, epochs=2, shuffle=True, verbose=0)
        params.append(trainer.params)
        evals.append(trainer.evaluate((x, y), batch_size=24, return_dict=True))
    tree_allclose(params[0], params[1], rtol=1e-5, atol=1e-6)
    assert evals[0]["loss"] == pytest.approx(evals[1]["loss"], rel=1e-5)
    sharded = namespace["JitDataParallel"]().put_batch({"x": x[:16]})["x"]
    assert len(sharded.sharding.device_set) == 8


class CompilesThroughOneEntry(tk.SingleDevice):
    """A strategy that sees every compile: ``Strategy.compile`` is the one entry point."""

    def __init__(self):
        super().__init__()
        self.kinds = []

    def compile(self, kind, fn, abstract_state):
        self.kinds.append(kind)
        return super().compile(kind, fn, abstract_state)


def test_every_step_is_compiled_through_strategy_compile():
    x, y = make_classification(64)
    results = []
    for strategy in (CompilesThroughOneEntry(), tk.SingleDevice()):
        trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy=strategy)
        trainer.fit((x, y), batch_size=16, epochs=1, shuffle=False, verbose=0)
        results.append((trainer.params, trainer.evaluate((x, y)), trainer.predict(x)))
    tree_allclose(results[0][0], results[1][0], rtol=0, atol=0)
    assert results[0][1] == results[1][1]


def test_a_strategy_overriding_compile_sees_train_eval_and_predict():
    x, y = make_classification(32)
    strategy = CompilesThroughOneEntry()
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy=strategy)
    trainer.fit((x, y), batch_size=16, epochs=1, verbose=0)
    trainer.evaluate((x, y))
    trainer.predict(x)
    assert strategy.kinds == ["train", "eval", "predict"]
