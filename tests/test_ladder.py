"""When no candidate fits, ``strategy="auto"`` (and ``plan``) try the memory measures in order of
cost: remat of the repeated blocks, optimizer offload, both. Each is planned as rows of its
own; the pick says what was added, and trains to the numbers of the same strategy without it."""

import functools

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from conftest import classifier

import trainkit as tk
from trainkit.planning import ladder


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1])(nn.tanh(nn.Dense(4 * x.shape[-1])(x)))


class Deep(nn.Module):
    """Six residual blocks and a head: activations (batch 1024) outweigh the parameters."""

    @nn.compact
    def __call__(self, x):
        for _ in range(6):
            x = Block()(x)
        return nn.Dense(4)(x)


rng = np.random.default_rng(0)
X, Y = rng.normal(size=(2048, 64)).astype(np.float32), rng.integers(0, 4, 2048).astype(np.int32)
deep = functools.partial(classifier, Deep(), optimizer=optax.adam(1e-3))


@pytest.fixture(scope="module")
def limit():
    """A memory limit below every plain candidate's compiled step (the smallest: FSDP's)."""
    plan = deep(strategy="auto").plan((X[:1024], Y[:1024]), verbose=0)
    return int(0.9 * min(row.total_bytes for row in plan.rows))


def test_auto_adds_remat_of_the_repeated_blocks_when_nothing_fits_and_says_so(limit):
    trainer = deep(strategy=tk.strategies.Auto(memory_limit=limit))
    history = trainer.fit(X, Y, batch_size=1024, epochs=2, verbose=0, shuffle=False)
    plan = trainer.last_plan
    names = [row.name for row in plan.rows]
    assert "FSDP(fsdp=8)" in names and "FSDP(fsdp=8) + remat" in names, names  # both planned, each a row
    assert plan.recommended.name == "FSDP(fsdp=8) + remat" and trainer.strategy.remat == ["Block"]
    assert "(added remat: no candidate fit without it)" in plan.reason()
    plain = deep(strategy=tk.FSDP())
    plain_history = plain.fit(X, Y, batch_size=1024, epochs=2, verbose=0, shuffle=False)
    assert history.history == plain_history.history  # remat recomputes: the same numbers
    for a, b in zip(jax.tree.leaves(trainer.state.params), jax.tree.leaves(plain.state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_ladder_tries_remat_then_offload_then_both_and_skips_what_the_trainer_has():
    assert [r.name for r in ladder.ladder(["Block"], can_offload=True)] == [
        "remat",
        "optimizer offload",
        "remat and optimizer offload",
    ]
    trainer = deep(strategy="auto", remat="full")  # remat already on: only offload left to add
    assert [r.name for r in trainer.setup.ladder(X[:8])] == ["optimizer offload"]
    fp16 = deep(strategy="auto", precision="fp16")  # loss scaling cannot offload: only remat
    assert [r.name for r in fp16.setup.ladder(X[:8])] == ["remat"]
    assert ladder.Rung("optimizer offload", offload=True).applied(tk.DataParallel()) is None


def test_when_no_measure_helps_the_error_lists_every_row_tried(limit):
    trainer = deep(strategy=tk.strategies.Auto(memory_limit=limit // 50))
    with pytest.raises(ValueError, match="found no strategy that runs this model and batch") as raised:
        trainer.fit(X, Y, batch_size=1024, epochs=1, verbose=0)
    for tried in (
        "FSDP(fsdp=8):",
        "FSDP(fsdp=8) + remat:",
        "FSDP(fsdp=8) + offload:",
        "FSDP(fsdp=8) + remat + offload:",
    ):
        assert tried in str(raised.value), tried


def test_find_batch_size_climbs_the_same_ladder_when_not_even_the_smallest_batch_fits():
    """Sequences of 512 positions: one row's activations outweigh the state, so remat lets it fit."""
    xs, ys = rng.normal(size=(16, 512, 64)).astype(np.float32), rng.integers(0, 4, (16, 512)).astype(np.int32)
    plain, remat = (
        deep(strategy="single", remat=r).plan((xs[:1], ys[:1]), candidates=[tk.SingleDevice()], verbose=0).rows[0]
        for r in (None, ["Block"])
    )
    limit = int((plain.total_bytes + remat.total_bytes) / 2 / 0.9)  # between them, within the 90% headroom
    trainer = deep(strategy="single")
    found = trainer.find_batch_size(xs, ys, memory_limit=limit, max_batch_size=16, verbose=0)
    assert (found.added, found.strategy) == ("remat", "SingleDevice + remat"), str(found)
    assert "(added remat: not even the smallest batch fit without it)" in str(found)
    assert sorted(found.plans) == [1, 2, 4][: len(found.plans)] and found.needed[1] == remat.total_bytes
    options = {"candidates": [tk.SingleDevice()], "memory_limit": limit, "verbose": 0}
    again = trainer.plan((xs, ys), batch_size=found.batch_size, **options)
    assert again.recommended.name == found.strategy and again.added == "remat"  # the plan agrees
    with pytest.raises(ValueError, match=r"Not even the smallest batch, 1 row, fits \(nor with remat or optimizer"):
        trainer.find_batch_size(xs, ys, memory_limit=limit // 50, max_batch_size=16, verbose=0)
