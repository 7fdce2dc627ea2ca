"""``strategy="auto"`` spends on comparing strategies only what the run can repay: the simplest
candidate that fits is compiled and timed first, and each other one only when its best case
could save more than its compile and timing within the run's steps."""

import jax
import numpy as np
import optax
from conftest import classifier, make_classification

import trainkit as tk
from trainkit.planning import budget as budget_lib
from trainkit.planning import plan as plan_lib


def trainer(strategy="auto"):
    return classifier(optimizer=optax.adam(1e-2), strategy=strategy)


def test_a_short_fit_compiles_only_the_simplest_candidate_and_says_why():
    x, y = make_classification(64)
    short = trainer()
    short.fit((x, y), batch_size=16, epochs=1, verbose=0)  # 4 steps: no split can repay a compile
    rows = {row.name: row for row in short.last_plan.rows}
    assert short.strategy is rows["SingleDevice"].strategy and rows["SingleDevice"].measured_seconds > 0
    for name in ("DataParallel(data=8)", "FSDP(fsdp=8)"):
        assert rows[name].compiled is None and rows[name].function is None and not rows[name].fits
        assert (
            rows[name].skipped.startswith("not compiled: at most") and "over this run's 4 steps" in rows[name].skipped
        )
    reason = short.last_plan.reason()
    assert "DataParallel(data=8), FSDP(fsdp=8) not compiled" in reason and "always_compare=True" in reason
    assert "not compiled: the run is too short" in str(short.last_plan)
    compared = trainer(tk.strategies.Auto(always_compare=True))
    compared.fit((x, y), batch_size=16, epochs=1, verbose=0)
    assert all(row.skipped is None and row.measured_seconds > 0 for row in compared.last_plan.rows)
    for a, b in zip(jax.tree.leaves(short.get_weights()), jax.tree.leaves(compared.get_weights())):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_a_run_long_enough_to_repay_the_compiles_compares_every_candidate(monkeypatch):
    # a slow step (10 s) on a host whose measured step kept one of two cores busy: a split could
    # at most halve it, saving 5 s a step against ~40 s to compile and time one: 9 steps repay it
    monkeypatch.setattr(plan_lib, "time_steps", lambda *args, **kwargs: budget_lib.Timing(10.0, 1.0))
    monkeypatch.setattr(budget_lib, "host_cores", lambda: 2)
    x, y = make_classification(64)
    short = trainer()
    short.fit((x, y), batch_size=16, epochs=2, verbose=0)  # 8 steps
    assert [row.skipped is None for row in short.last_plan.rows] == [True, False, False]
    long = trainer()
    long.fit((x, y), batch_size=16, epochs=3, verbose=0)  # 12 steps
    assert all(row.skipped is None and row.fits and row.measured_seconds == 10.0 for row in long.last_plan.rows)
    assert long.strategy is long.last_plan.rows[0].strategy  # equal times: the simplest is kept


def test_the_bound_is_the_devices_on_accelerators_and_the_idle_cores_on_a_cpu():
    assert budget_lib.speedup_bound(devices=8, platform="gpu", busy_cores=1.0, cores=2) == 8
    assert budget_lib.speedup_bound(devices=8, platform="cpu", busy_cores=1.0, cores=4) == 4
    assert budget_lib.speedup_bound(devices=2, platform="cpu", busy_cores=1.0, cores=16) == 2
    assert budget_lib.speedup_bound(devices=8, platform="cpu", busy_cores=4.0, cores=4) == 1  # the host is busy
    never = budget_lib.Worth.of(step_seconds=1.0, bound=1.0, cost_seconds=1.0)
    assert never.break_even_steps == float("inf") and not never.pays(10**9) and never.pays(None)
