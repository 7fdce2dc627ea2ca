"""Faults that must lose nothing, each with a real process that is killed and run again."""

import json
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import optax
import pytest
from conftest import MLP, make_classification, subprocess_cache_env

import trainkit as tk

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "resumable_fit.py"
PREEMPTED_EXIT_CODE = 143


def start(backup, out, *extra, optimised=False):
    """The script in a new process, compiled as the tests compile (``optimised``: as users do,
    which pays where a run's time is spent running large steps rather than compiling small ones)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | subprocess_cache_env()
    if optimised:
        env["XLA_FLAGS"] = ""
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(backup), str(out), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def finish(backup, out, *extra, optimised=False):
    process = start(backup, out, *extra, optimised=optimised)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    return output


def uninterrupted(root, *extra, optimised=False):
    """The parameters and output of a run never interrupted and without backups (so the saves of
    the runs compared with it must change no number)."""
    return started_uninterrupted(root, *extra, optimised=optimised)()


def started_uninterrupted(root, *extra, optimised=False):
    """:func:`uninterrupted` started now (it runs beside a test's own runs, which are mostly their
    start and compile): a function that waits for it and returns its parameters and output."""
    process = start(root / "backup", root / "ref.npz", "--no-backup", *extra, optimised=optimised)

    def result():
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, output
        assert not (root / "backup").exists()
        return params(root / "ref.npz"), output

    return result


def committed_steps(backup):
    if not backup.exists():
        return []
    return sorted(int(p.name) for p in backup.iterdir() if p.name.isdigit() and (p / "commit_success.txt").exists())


def wait_for(condition, timeout=120.0, poll=0.005):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError("timed out waiting")


def params(path):
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def journal_step(backup):
    """The last step the goodput journal recorded (``None``: none yet)."""
    try:
        return json.loads((backup / "goodput.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return None


def assert_bit_identical(a, b):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The uninterrupted runs' parameters by strategy (``dp``, ``fsdp``), run side by side."""
    runs = {
        strategy: started_uninterrupted(tmp_path_factory.mktemp(f"{strategy}_reference"), "--strategy", strategy)
        for strategy in ("dp", "fsdp")
    }
    return {strategy: run()[0] for strategy, run in runs.items()}


@pytest.fixture
def reference(references):
    return references["dp"]


@pytest.mark.parametrize(
    ("strategy", "offload"),
    [("dp", ()), ("fsdp", ()), ("fsdp", ("--offload", "optimizer"))],
    ids=["dp", "fsdp", "fsdp_offload"],
)
def test_kill_9_at_a_random_step_then_rerun_finishes_bit_identical(tmp_path, references, strategy, offload):
    """Killed and rerun, a run ends on the bits of one never interrupted; with the optimizer's
    state in host memory (``offload``), on the bits of the uninterrupted run without it."""
    reference = references[strategy]
    backup = tmp_path / "backup"
    journal = ("--journal-seconds", "0")  # the goodput journal rewritten every step
    process = start(backup, tmp_path / "out.npz", "--sleep", "0.03", "--strategy", strategy, *journal, *offload)
    wait_for(lambda: committed_steps(backup) and (journal_step(backup) or 0) >= committed_steps(backup)[-1] + 2)
    time.sleep(random.uniform(0.0, 0.4))
    process.kill()  # SIGKILL
    process.wait()
    killed_at, reached = committed_steps(backup), journal_step(backup)
    assert killed_at and killed_at[-1] < 52  # it died mid-run
    output = finish(backup, tmp_path / "out.npz", "--strategy", strategy, *offload)
    resumed = int(re.search(r"resuming from step (\d+)", output).group(1))
    assert_bit_identical(params(tmp_path / "out.npz"), reference)
    # the goodput ledger: the steps run after the backup it resumed from are lost, and their time
    found = re.search(r"goodput: lost_steps=(\d+) restarts=(\d+) lost=([\d.e-]+)", output)
    assert found and (int(found.group(1)), int(found.group(2))) == (reached - resumed, 1), (output, reached)
    assert float(found.group(3)) >= 0.03 * (reached - resumed), output  # at least the sleeps of the lost steps


def test_kill_9_mid_epoch_of_a_grain_iterator_resumes_bit_identical_without_replaying(tmp_path):
    pytest.importorskip("grain")
    reference_run = started_uninterrupted(tmp_path / "reference", "--data", "grain")
    backup = tmp_path / "backup"
    process = start(backup, tmp_path / "out.npz", "--sleep", "0.03", "--data", "grain", "--every", "1")
    wait_for(lambda: [s for s in committed_steps(backup) if 14 <= s <= 40])  # in the second epoch or later
    process.kill()  # SIGKILL
    process.wait()
    output = finish(backup, tmp_path / "out.npz", "--data", "grain")
    resumed = int(re.search(r"resuming from step (\d+) \(epoch (\d+), batch (\d+)\)", output).group(1))
    assert 14 <= resumed < 52, output
    # The iterator continued from its saved position: only the remaining batches were read
    # (and the one read to learn the shapes, before the backup was found).
    assert f"read {(52 - resumed) * 16 + 16} rows" in output, output
    reference, output = reference_run()
    assert "finished at step 52; read 832 rows" in output  # 52 batches of 16
    assert_bit_identical(params(tmp_path / "out.npz"), reference)


def test_kill_9_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path):
    backup = tmp_path / "backup"
    wide = ("--width", "60000")  # about 1 MB of parameters and 2 MB of Adam state per save
    reference, _ = uninterrupted(tmp_path / "reference", *wide, optimised=True)
    process = start(backup, tmp_path / "out.npz", *wide, optimised=True)
    first = wait_for(lambda: committed_steps(backup))[-1]

    def saving_a_later_step():
        tmp = [p.name for p in backup.iterdir() if "tmp" in p.name]
        return tmp if tmp and not any(n.split(".")[0] == str(first) for n in tmp) else None

    in_progress = wait_for(saving_a_later_step, poll=0.0005)
    process.kill()
    process.wait()
    complete = committed_steps(backup)
    half_written = int(in_progress[0].split(".")[0])
    assert half_written not in complete  # the half-written save never became a checkpoint
    output = finish(backup, tmp_path / "out.npz", *wide, optimised=True)
    resumed = int(re.search(r"resuming from step (\d+)", output).group(1))
    assert resumed == complete[-1] < half_written
    assert_bit_identical(params(tmp_path / "out.npz"), reference)


def test_sigterm_finishes_the_step_writes_a_backup_and_exits_143(tmp_path, reference):
    backup = tmp_path / "backup"
    process = start(backup, tmp_path / "out.npz", "--sleep", "0.03")
    wait_for(lambda: committed_steps(backup))
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == PREEMPTED_EXIT_CODE, output
    written = int(re.search(r"backup of step (\d+) written", output).group(1))
    assert committed_steps(backup)[-1] == written
    output = finish(backup, tmp_path / "out.npz")
    assert f"resuming from step {written}" in output
    assert_bit_identical(params(tmp_path / "out.npz"), reference)


class SlowRows:
    """A picklable random-access source that takes its time per row (a decoder)."""

    def __init__(self, n):
        self.x, self.y = make_classification(n)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        time.sleep(0.002)
        return self.x[i], self.y[i]


def test_a_killed_data_worker_ends_the_epoch_with_an_error_naming_it(tmp_path):
    """SIGKILL (the OOM killer) to one of two worker processes at batch 5: fit raises within
    seconds naming the worker and the signal, instead of waiting forever for its batch."""
    import multiprocessing

    source = tk.sources.RandomAccessSource(SlowRows(640), workers=2)
    others = {child.pid for child in multiprocessing.active_children()}  # earlier tests' processes

    class KillAWorker(tk.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                victim = next(c for c in multiprocessing.active_children() if c.pid not in others)
                os.kill(victim.pid, signal.SIGKILL)
                self.killed, self.step = victim.pid, self.model.global_step

    killer = KillAWorker()
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"data worker process .* died \(pid \d+ killed by SIGKILL") as raised:
        trainer.fit(source, batch_size=16, epochs=1, verbose=0, callbacks=[killer])
    assert time.monotonic() - started < 60
    assert f"pid {killer.killed} killed by SIGKILL" in str(raised.value)
    assert trainer.global_step >= killer.step  # the steps trained stay; nothing after the lost batch
    trainer.fit(source, batch_size=16, epochs=1, verbose=0)  # new workers: the source reads again
    assert trainer.global_step >= killer.step + 40
    source.close()


def test_workers_need_a_picklable_source():
    class Local:  # a class inside a function cannot be pickled
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return np.zeros(3, np.float32), 0

    source = tk.sources.RandomAccessSource(Local(), workers=2)
    trainer = tk.Trainer(MLP(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single")
    with pytest.raises(
        ValueError, match=r"workers=2\) sends the source to each worker process, but it cannot be pickled"
    ):
        trainer.fit(source, batch_size=2, epochs=1, verbose=0)
