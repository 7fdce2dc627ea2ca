"""The compiled plan (per-device memory, cost, collectives), "auto" choosing from it, and the
inspection helpers (describe_sharding, lowered_text, compiled_text)."""

import gc
import logging

import jax
import numpy as np
import optax
import pytest
from conftest import Wide, classifier

import trainkit as tk
from trainkit.planning.plan import collective_traffic


def make_trainer(strategy="dp", **options):
    return classifier(Wide(), optimizer=optax.adam(1e-3), strategy=strategy, **options)


def data(n=32):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 64)).astype(np.float32), rng.integers(0, 8, n).astype(np.int32)


WITH_HYBRIDS = [tk.SingleDevice(), tk.DataParallel(), tk.FSDP(), tk.Hybrid(data=2, fsdp=4), tk.Hybrid(data=4, fsdp=2)]


@pytest.fixture(scope="module")
def plan():
    return make_trainer().plan(data(), candidates=WITH_HYBRIDS, verbose=0)


def test_the_default_candidates_are_the_three_families_on_one_process():
    assert [tk.plan.short_name(s) for s in tk.plan.default_candidates()] == [
        "SingleDevice",
        "DataParallel(data=8)",
        "FSDP(fsdp=8)",
    ]


def test_plan_has_a_row_per_candidate_with_compiled_figures(plan):
    rows = {r.name: r for r in plan.rows}
    assert list(rows) == [
        "SingleDevice",
        "DataParallel(data=8)",
        "FSDP(fsdp=8)",
        "Hybrid(data=2, fsdp=4)",
        "Hybrid(data=4, fsdp=2)",
    ]
    for row in plan.rows:
        assert row.error is None and row.flops > 0 and row.bytes_accessed > 0
        assert row.total_bytes == row.argument_bytes + row.output_bytes - row.alias_bytes + row.temp_bytes
    # Adam state + params: FSDP's per-device arguments are a fraction of replicated DP's
    assert rows["FSDP(fsdp=8)"].argument_bytes < rows["DataParallel(data=8)"].argument_bytes / 4
    assert rows["Hybrid(data=2, fsdp=4)"].argument_bytes < rows["DataParallel(data=8)"].argument_bytes / 2
    assert rows["SingleDevice"].collectives == {}
    assert rows["DataParallel(data=8)"].collectives.get("all-reduce", 0) >= 1
    fsdp = rows["FSDP(fsdp=8)"].collectives
    assert fsdp.get("all-gather", 0) + fsdp.get("reduce-scatter", 0) >= 1, fsdp
    assert sum(r.recommended for r in plan.rows) == 1
    text = str(plan)
    assert "<-" in text and "FSDP(fsdp=8)" in text and f"picked {plan.recommended.name}" in text


def test_plan_allocates_no_state():
    gc.collect()
    before = {id(a) for a in jax.live_arrays()}
    make_trainer().plan(data(), verbose=0)
    gc.collect()
    new = [a.shape for a in jax.live_arrays() if id(a) not in before]
    assert (256, 256) not in new, new


def shapes_of(*arrays):
    return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)


def test_a_plan_from_shapes_is_the_plan_from_arrays(plan):
    from_shapes = make_trainer().plan(shapes_of(*data()), candidates=WITH_HYBRIDS, verbose=0)
    for a, b in zip(plan.rows, from_shapes.rows, strict=True):
        assert (a.name, a.fits, a.argument_bytes, a.total_bytes, a.flops) == (
            b.name,
            b.fits,
            b.argument_bytes,
            b.total_bytes,
            b.flops,
        )
    assert from_shapes.recommended.name == plan.recommended.name


def test_a_4_gib_batch_of_shapes_plans_without_being_built():
    import resource

    x, y = jax.ShapeDtypeStruct((2**24, 64), np.float32), jax.ShapeDtypeStruct((2**24,), np.int32)  # 4 GiB of x
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = make_trainer().plan((x, y), candidates=[tk.FSDP()], memory_limit="64GiB", verbose=0)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak
    assert result.rows[0].fits and result.rows[0].argument_bytes > 2**32 // 8, result.rows[0]  # its batch shard
    assert grown < 2**30, f"the peak memory grew {grown / 2**30:.1f} GiB"


def test_shapes_are_planned_not_measured_and_not_mixed_with_arrays():
    x, y = data()
    with pytest.raises(ValueError, match="measure=True times steps on data.*jax.ShapeDtypeStruct"):
        make_trainer().plan(shapes_of(x, y), measure=True, verbose=0)
    with pytest.raises(TypeError, match="mixes jax.ShapeDtypeStruct leaves with arrays"):
        make_trainer().plan((shapes_of(x)[0], y), verbose=0)


def test_a_long_reason_is_printed_whole_under_the_table_and_the_figures_stay(plan):
    import dataclasses
    import io

    from rich.console import Console

    reason = "RESOURCE_EXHAUSTED: " + "a long compiler message " * 12 + "END"
    rows = [dataclasses.replace(r, error=reason) if r.name == "SingleDevice" else r for r in plan.rows]
    out = io.StringIO()
    dataclasses.replace(plan, rows=rows).print(Console(width=80, file=out, color_system=None))
    text = out.getvalue()
    from trainkit.planning.plan import _mib

    for row in [r for r in plan.rows if r.name.startswith(("DataParallel", "FSDP"))]:  # figures whole at 80 columns
        line = next(line for line in text.splitlines() if "│" in line and row.name[:6] in line)
        for figure in (row.argument_bytes, row.temp_bytes, row.total_bytes):
            assert f" {_mib(figure)} " in line, (row.name, line)
    assert "END" in " ".join(text.split()) and "see below" in text, text


def test_first_fit_stops_compiling_at_the_first_candidate_that_fits(plan):
    rows = {r.name: r for r in plan.rows}
    limit = int((rows["FSDP(fsdp=8)"].total_bytes + rows["DataParallel(data=8)"].total_bytes) / 2 / tk.plan.HEADROOM)
    order = [tk.SingleDevice(), tk.DataParallel(), tk.FSDP(), tk.Hybrid(data=2, fsdp=4)]
    result = make_trainer().plan(data(), candidates=order, memory_limit=limit, first_fit=True, verbose=0)
    found = {r.name: r for r in result.rows}
    assert not found["SingleDevice"].fits and not found["DataParallel(data=8)"].fits
    assert found["FSDP(fsdp=8)"].fits and found["FSDP(fsdp=8)"].recommended
    hybrid = found["Hybrid(data=2, fsdp=4)"]
    assert hybrid.function is None and hybrid.skipped.startswith("not compiled (first_fit=True: FSDP(fsdp=8) fits)")
    assert "not compiled: first_fit" in str(result)


def test_a_small_memory_limit_excludes_the_replicated_strategies(plan):
    rows = {r.name: r for r in plan.rows}
    # between what FSDP needs and what replicated data parallelism needs
    limit = int((rows["FSDP(fsdp=8)"].total_bytes + rows["DataParallel(data=8)"].total_bytes) / 2 / tk.plan.HEADROOM)
    trainer = make_trainer(tk.strategies.Auto(memory_limit=limit, measure=False))
    result = trainer.plan(data(), memory_limit=limit, verbose=0)
    fits = {r.name for r in result.rows if r.fits}
    assert "DataParallel(data=8)" not in fits and "SingleDevice" not in fits and "FSDP(fsdp=8)" in fits
    trainer.fit(data(), batch_size=32, epochs=1, verbose=0)
    assert trainer.last_plan.recommended.name in fits
    assert tk.plan.short_name(trainer.strategy) == trainer.last_plan.recommended.name


def test_candidates_whose_state_alone_exceeds_the_limit_are_skipped_without_compiling(plan):
    rows = {r.name: r for r in plan.rows}
    # a limit FSDP's whole step fits under, but not a replicated copy of the parameters and Adam state
    limit = int(rows["FSDP(fsdp=8)"].total_bytes * 1.2 / tk.plan.HEADROOM)
    assert rows["DataParallel(data=8)"].argument_bytes > tk.plan.HEADROOM * limit
    result = make_trainer().plan(data(), memory_limit=limit, verbose=0)
    rows = {r.name: r for r in result.rows}
    for name in ("SingleDevice", "DataParallel(data=8)"):
        assert rows[name].error.startswith("skipped without compiling: the state alone needs"), rows[name].error
        assert rows[name].function is None and rows[name].argument_bytes == 0  # never compiled
    assert rows["FSDP(fsdp=8)"].error is None and rows["FSDP(fsdp=8)"].fits
    assert result.recommended.name != "DataParallel(data=8)"


def test_no_strategy_fits_is_a_clear_error():
    trainer = make_trainer(tk.strategies.Auto(memory_limit=1000, measure=False))
    with pytest.raises(ValueError, match=r"found no strategy.*grad_accum_steps"):
        trainer.fit(data(), batch_size=32, verbose=0)
    assert trainer.state is None


def test_measured_auto_picks_the_fastest_fitting_row(caplog):
    trainer = make_trainer("auto")
    with caplog.at_level(logging.INFO, logger="trainkit"):
        trainer.fit(data(), batch_size=32, epochs=1, verbose=0)
    plan = trainer.last_plan
    assert plan.measured and all(r.measured_seconds > 0 for r in plan.rows if r.fits)
    best = min((r for r in plan.rows if r.fits), key=lambda r: r.measured_seconds)
    assert plan.recommended is best and trainer.strategy is best.strategy
    assert any(f"picked {best.name}: measured" in m for m in caplog.messages)


def test_plan_under_an_auto_with_candidates_plans_those_and_picks_what_fit_picks():
    auto = tk.strategies.Auto(measure=False, candidates=[tk.FSDP(), tk.Hybrid(data=2, fsdp=4)])
    trainer = make_trainer(auto)
    plan = trainer.plan(data(), verbose=0)
    assert [row.name for row in plan.rows] == ["FSDP(fsdp=8)", "Hybrid(data=2, fsdp=4)"]
    trainer.fit(data(), batch_size=32, epochs=1, verbose=0)
    assert tk.plan.short_name(trainer.strategy) == plan.recommended.name


def test_candidates_that_cannot_split_the_batch_carry_the_reason():
    result = make_trainer().plan(data(12), verbose=0)  # 12 rows: not a multiple of 8
    rows = {r.name: r for r in result.rows}
    assert rows["SingleDevice"].recommended
    assert "cannot be split evenly across 8 devices" in rows["FSDP(fsdp=8)"].error


def test_collective_traffic_reads_compiled_hlo():
    hlo = """
  %all-reduce.3 = (f32[1024]{0}, f32[16,4]{1,0}) all-reduce(%a, %b), channel_id=1
  %reduce-scatter = bf16[128,64]{1,0} reduce-scatter(%g), dimensions={0}
  %ag-start = (f32[8,64]{1,0}, f32[64,64]{1,0}) all-gather-start(%p), dimensions={0}
  %ag-done = f32[64,64]{1,0} all-gather-done(%ag-start)
"""
    total, counts = collective_traffic(hlo)
    assert counts == {"all-reduce": 1, "reduce-scatter": 1, "all-gather": 1}
    assert total == (1024 + 64) * 4 + 128 * 64 * 2 + 64 * 64 * 4


# ---------------------------------------------------------------------- inspection
@pytest.fixture(scope="module")
def fsdp_trainer():
    trainer = make_trainer(tk.FSDP())
    trainer.fit(data(), batch_size=32, epochs=1, verbose=0)
    return trainer


def test_describe_sharding_lists_each_leaf(fsdp_trainer, capsys):
    rows = {r.path: r for r in tk.debug.sharding_rows(fsdp_trainer)}
    kernel = rows["params/Dense_1/kernel"]
    assert kernel.shape == (256, 256) and kernel.dtype == "float32"
    assert kernel.device_bytes * 8 == kernel.total_bytes == 256 * 256 * 4
    assert "fsdp" in kernel.spec
    assert rows["params/Dense_2/bias"].spec == "P()"  # 8 elements: replicated
    tk.debug.describe_sharding(fsdp_trainer)
    out = capsys.readouterr().out
    assert "params/Dense_1/kernel" in out and "32,768" in out and "FSDP" in out
    tk.debug.visualize_leaf(fsdp_trainer, "params/Dense_1/kernel")
    drawn = capsys.readouterr().out
    assert all(f"CPU {i}" in drawn for i in range(8)), drawn
    with pytest.raises(KeyError, match="params/Dense_1/kernel"):
        tk.debug.visualize_leaf(fsdp_trainer, "params/Dense_9/kernel")


def test_lowered_and_compiled_text(fsdp_trainer):
    lowered = fsdp_trainer.lowered_text()
    assert "func.func" in lowered and "sharding" in lowered
    compiled = fsdp_trainer.compiled_text()
    assert "HloModule" in compiled and ("all-gather" in compiled or "reduce-scatter" in compiled)
    x, y = data(16)
    assert "16x64" in fsdp_trainer.lowered_text((x, y))
    with pytest.raises(ValueError, match="Pass a sample batch"):
        trainer = make_trainer("single")
        trainer.init(data())
        trainer.lowered_text()


def test_the_plan_command_says_a_refusal_in_one_line_without_a_traceback(tmp_path):
    """#59: the CLI printed 4 to 8 traceback lines before trainkit's clear message."""
    import subprocess
    import sys

    script = tmp_path / "planme.py"
    script.write_text(
        "import numpy as np, optax, flax.linen as nn, trainkit as tk\n"
        "def make():\n"
        "    trainer = tk.Trainer(nn.Dense(2), loss='mse', optimizer=optax.sgd(0.1), strategy='single')\n"
        "    return trainer, (np.ones((8, 3), np.float32), np.ones((8, 2), np.float32))\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "trainkit", "plan", f"{script}:make", "--target", "tpu v9:1x1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    # refused before JAX starts: no line of its plugins' logging (the CUDA plugin's, when installed) comes first
    assert result.stderr.startswith("python -m trainkit plan: ValueError: Unknown target 'tpu v9:1x1'")
    assert len(result.stderr.splitlines()) == 1
