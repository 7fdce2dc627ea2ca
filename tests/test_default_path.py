"""The default path trusted (#32): what a newcomer from Keras or Flax meets first either gives
the right result or stops with an error that names the fix."""

import sys
import warnings

import flax.linen as nn
import numpy as np
import optax
import pytest
from conftest import MLP
from flax import nnx

import trainkit as tk

N = 40


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 4)).astype("float32"), rng.integers(0, 3, N).astype("int32")


def classifier(model=None, **kwargs):
    kwargs.setdefault("strategy", "single")
    return tk.Trainer(model or MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), **kwargs)


class _NNXLinear(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


class _TutorialDropout(nnx.Module):
    """Flax's NNX tutorial style: the random streams passed at call time."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(4, 3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        return self.dropout(self.linear(x), rngs=rngs)


def test_a_module_class_and_call_time_rngs_are_refused_with_the_way_to_write_them():
    with pytest.raises(TypeError, match=r"received the class MLP itself\. Instantiate it: Trainer\(MLP\(\), \.\.\.\)"):
        classifier(MLP)
    with pytest.raises(TypeError, match=r"Instantiate it: Trainer\(_NNXLinear\(rngs=nnx\.Rngs\(0\)\)"):
        classifier(_NNXLinear)
    with pytest.raises(TypeError, match=r"takes rngs, which trainkit does not pass.*nnx\.Dropout\(0\.5, rngs=rngs\)"):
        classifier(_TutorialDropout(nnx.Rngs(0)))


class _ModeFlag(nn.Module):
    """Dropout switched by a flag of a name trainkit does not set."""

    @nn.compact
    def __call__(self, x, mode: bool = False):
        return nn.Dense(3)(nn.Dropout(0.5)(x, deterministic=not mode))


class _BatchNormModeFlag(nn.Module):
    @nn.compact
    def __call__(self, x, mode: bool = False):
        return nn.Dense(3)(nn.BatchNorm()(x, use_running_average=not mode))


class _AlwaysBatchStats(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.BatchNorm(use_running_average=False)(x))


class _DropoutFixedOff(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.Dropout(0.5, deterministic=True)(x))


class _DropoutWithoutFlag(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.Dropout(0.5)(x))


class _ReadsKey(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x["image"])


def test_layers_a_train_flag_never_reaches_are_named_before_the_first_step(data):
    x, y = data
    for model, layer in ((_ModeFlag(), r"Dropout_0 \(Dropout\)"), (_BatchNormModeFlag(), r"BatchNorm_0 \(BatchNorm\)")):
        trainer = classifier(model)
        with pytest.raises(ValueError, match=layer + r".*takes none of the flags trainkit sets \(train, training"):
            trainer.fit(x, y, verbose=0)
        assert trainer.state is None  # nothing was built
    classifier(_DropoutFixedOff()).fit(x, y, verbose=0)  # off by construction: the user's choice


def test_a_model_error_gets_the_hint_for_its_kind_only(data):
    x, y = data
    with pytest.raises(ValueError, match=r"(?s)train: bool = False.*deterministic=not train") as raised:
        classifier(_DropoutWithoutFlag()).fit(x, y, verbose=0)
    assert "channel axis" not in str(raised.value)
    with pytest.raises(ValueError, match=r"(?s)batch_stats.*immutable.*train: bool = False"):
        classifier(_AlwaysBatchStats()).fit(x, y, verbose=0)  # batch statistics in evaluation too
    with pytest.raises(ValueError, match=r"(?s)looked up .image., which its inputs lack.*the dict.s keys") as raised:
        classifier(_ReadsKey()).fit({"pixels": x}, y, verbose=0)
    assert "channel axis" not in str(raised.value)


def test_a_python_list_is_named_with_np_asarray(data):
    x, y = data
    with pytest.raises(ValueError, match=r"y is a Python list of 40 values, not an array.*np\.asarray\(y\)"):
        classifier().fit(x, y.tolist(), verbose=0)
    two_inputs = [x, x]  # Keras's multi-input x stays a list of arrays
    assert tk.data.as_dataset(two_inputs, y).num_examples == N


def test_a_strategy_shows_its_configuration():
    assert repr(tk.SingleDevice()) == "SingleDevice(cpu:0)"
    assert (repr(tk.FSDP()), repr(tk.DataParallel())) == ("FSDP(fsdp=8)", "DataParallel(data=8)")
    assert repr(tk.Hybrid(data=2, fsdp=4)) == "Hybrid(data=2, fsdp=4)"


def test_max_steps_with_epochs_left_out_trains_until_max_steps(data):
    x, y = data  # 40 rows in batches of 8: 5 steps an epoch
    trainer = classifier()
    history = trainer.fit(x, y, batch_size=8, max_steps=12, verbose=0)
    assert trainer.session.position.step == 12 and len(history.history["loss"]) == 3  # Keras: ceil(12 / 5) epochs
    trainer = classifier()
    trainer.fit(x, y, batch_size=8, epochs=None, max_steps=7, verbose=0)
    assert trainer.session.position.step == 7
    trainer = classifier()
    trainer.fit(x, y, batch_size=8, epochs=1, max_steps=12, verbose=0)  # an explicit epoch count still bounds it
    assert trainer.session.position.step == 5
    trainer = classifier()
    assert len(trainer.fit(x, y, batch_size=8, verbose=0).history["loss"]) == 1  # Keras's default: one epoch

    def endless():
        while True:
            yield x[:8], y[:8]

    trainer = classifier()
    trainer.fit(endless(), max_steps=9, verbose=0)
    assert trainer.session.position.step == 9


def test_a_batch_larger_than_the_data_is_one_batch_of_all_rows(data):
    x, y = data
    capped = classifier(strategy=tk.DataParallel())
    with pytest.warns(UserWarning, match=r"batch_size=30000000 is more than the 40 rows.*padded to 40") as caught:
        history = capped.fit(x, y, batch_size=30_000_000, shuffle=False, verbose=0)
    assert caught[0].filename == __file__  # the user's line, not trainkit's
    assert capped.session.batch_size == 40  # 40 rows, a multiple of the 8 devices: no padding at all
    whole = classifier(strategy=tk.DataParallel()).fit(x, y, batch_size=40, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], whole.history["loss"], rtol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Keras's default batch of 32 on fewer rows is capped without a word
        classifier(strategy=tk.DataParallel()).fit(x[:10], y[:10], verbose=0)
    found = classifier().find_batch_size(np.repeat(x, 38, axis=0)[:1500], np.repeat(y, 38)[:1500], verbose=0)
    assert found.batch_size == 1500  # the data, not 65,536


class _BatchNormed(nn.Module):
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)(nn.Dense(8)(x))
        return nn.Dense(3)(x)


def test_auto_never_picks_a_strategy_that_changes_what_batchnorm_computes(data):
    x, y = data
    candidates = [tk.DataParallel(), tk.FSDP()]  # pmap first: by estimate it would be picked
    trainer = classifier(_BatchNormed(), strategy=tk.strategies.Auto(measure=False, candidates=candidates))
    trainer.fit(x, y, batch_size=8, verbose=0)
    plan = trainer.last_plan
    pmap_row = next(row for row in plan.rows if row.name.startswith("DataParallel"))
    assert pmap_row.error.startswith("not a candidate: BatchNorm_0 (BatchNorm) normalises each device's rows")
    assert pmap_row.left_out and not any(row.left_out for row in plan.rows if row is not pmap_row)
    assert isinstance(trainer.strategy, tk.FSDP) and "DataParallel(data=8) not a candidate" in plan.reason()
    # reducing over the device axis keeps pmap a candidate (and the others, without that axis, fail)
    reducing = classifier(_BatchNormed("data"), strategy=tk.strategies.Auto(measure=False, candidates=candidates))
    reducing.fit(x, y, batch_size=8, verbose=0)
    assert isinstance(reducing.strategy, tk.DataParallel)


def test_an_explicit_data_parallel_says_its_statistics_are_per_device(data):
    x, y = data
    with pytest.warns(UserWarning, match=r"own batch statistics under DataParallel.*axis_name='data'") as caught:
        classifier(_BatchNormed(), strategy=tk.DataParallel()).fit(x, y, batch_size=8, verbose=0)
    assert (caught[0].filename, caught[0].lineno) == (__file__, sys._getframe().f_lineno - 1)  # the fit line
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        classifier(_BatchNormed("data"), strategy=tk.DataParallel()).fit(x, y, batch_size=8, verbose=0)


class _Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.second = nnx.Linear(8, 8, rngs=rngs)  # declared first, called second
        self.first = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return self.second(nnx.relu(self.first(x)))


class _NNXNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.head = nnx.Linear(8, 3, rngs=rngs)
        self.block = _Block(rngs)
        self.stem = nnx.Linear(4, 8, rngs=rngs)
        self.spare = nnx.Linear(2, 2, rngs=rngs)  # never called

    def __call__(self, x):
        return self.head(self.block(self.stem(x)))


def test_an_nnx_summary_lists_modules_in_call_order_with_shapes_and_auto_chooses_nothing(data):
    import io

    from rich.console import Console

    from trainkit.monitoring.summary import summary_rows

    x, y = data
    calls = (nnx.Linear.__call__, "__call__" in _Block.__dict__)
    trainer = tk.Trainer(_NNXNet(nnx.Rngs(0)), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3))
    buffer = io.StringIO()
    trainer.summary((x, y), console=Console(file=buffer, width=120))
    assert trainer.strategy is None and trainer.state is None  # "auto" traced the sample, compiled no candidate
    assert "Train step FLOPs: " in buffer.getvalue() and "per batch of 40" in buffer.getvalue()
    inputs = trainer.setup.summary_inputs((x, y))
    rows = [
        (r.path, r.kind, r.output_shape, r.params) for r in summary_rows(trainer.setup.program.adapter, *inputs[1::-1])
    ]
    assert rows == [
        ("stem", "Linear", "(None, 8)", 40),
        ("block", "_Block", "(None, 8)", 144),
        ("block/first", "Linear", "(None, 8)", 72),
        ("block/second", "Linear", "(None, 8)", 72),
        ("head", "Linear", "(None, 3)", 27),
        ("spare", "Linear", "?", 6),
    ]
    assert (nnx.Linear.__call__, "__call__" in _Block.__dict__) == calls  # the classes' own calls put back


def test_loading_a_checkpoint_prints_no_read_only_notice(data, tmp_path, caplog):
    import logging

    x, y = data
    trainer = classifier()
    trainer.fit(x, y, verbose=0)
    trainer.save(tmp_path / "run")
    restored = classifier()
    restored.init((x, y))
    with caplog.at_level(logging.INFO):
        restored.load(tmp_path / "run")
    assert not [r.getMessage() for r in caplog.records if "read only" in r.getMessage()]
    np.testing.assert_array_equal(restored.params["Dense_0"]["kernel"], trainer.params["Dense_0"]["kernel"])


def test_init_and_the_finders_under_auto_time_no_candidate(data, monkeypatch):
    from trainkit.planning import plan as plan_lib

    def timed(*args, **kwargs):
        raise AssertionError("a candidate was timed")

    monkeypatch.setattr(plan_lib, "time_steps", timed)
    x, y = data
    lr_trainer = tk.Trainer(
        MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.inject_hyperparams(optax.sgd)(0.1)
    )
    lr_trainer.find_learning_rate(x, y, batch_size=8, steps=4)
    assert lr_trainer.strategy is not None and not lr_trainer.last_plan.measured  # chosen by the estimate
    classifier(strategy="auto").find_batch_size(x, y, verbose=0)
    initialised = classifier(strategy="auto")
    initialised.init((x, y))
    assert not initialised.last_plan.measured
    with pytest.raises(AssertionError, match="a candidate was timed"):
        classifier(strategy="auto").fit(x, y, verbose=0)  # training measures
