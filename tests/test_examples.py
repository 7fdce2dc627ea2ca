"""The README's example runs end to end and reaches its accuracy target."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import run_example_here

ROOT = pathlib.Path(__file__).parent.parent


def test_digits_cnn_reaches_95_percent_on_8_fake_devices(tmp_path):
    """The headline number is measured on a test split that no callback saw (`make example` runs it in a
    process of its own, fully optimised)."""
    result = run_example_here("digits_cnn.py", "--devices", "8", "--verbose", "0", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "trainkit" in result.stdout and "on 8 cpu devices" in result.stdout
    assert re.search(r"strategy='auto' picked \w+(\([^)]*\))?: measured [\d.]+ ms/step", result.stdout), result.stdout
    accuracy = float(re.search(r"test accuracy (\d\.\d+)", result.stdout).group(1))
    assert accuracy >= 0.95  # on the test split, which neither EarlyStopping nor ModelCheckpoint saw
    best = float(re.search(r"best epoch \d+ \(val_accuracy (\d\.\d+)\) restored", result.stdout).group(1))
    log = (tmp_path / "log.csv").read_text().splitlines()
    header = log[0].split(",")
    validation = [float(row.split(",")[header.index("val_accuracy")]) for row in log[1:]]
    assert best == pytest.approx(max(validation), abs=1e-4)  # picked on the validation split (printed to 4 places)
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "curves.png").stat().st_size > 10_000
    if importlib.util.find_spec("tensorboardX"):
        assert (tmp_path / "tensorboard" / "validation").is_dir()
    rows = (tmp_path / "log.csv").read_text().splitlines()
    assert rows[0].startswith("epoch,accuracy,learning_rate,loss,val_accuracy,val_loss") and len(rows) > 2
    assert (tmp_path / "best").is_dir()


def test_the_served_gpt2_example_reads_back_with_trainkits_logits_and_greedy_tokens(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    prompt = "Beautiful is better than ugly. Explicit is better than impl"  # 58 characters: 6 greedy steps to 64
    result = run_example_here("serve_gpt2.py", "--epochs", "3", "--prompt", prompt, "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "loaded 28 tensors" in result.stdout and "save_pretrained wrote config.json, model.safetensors" in result.stdout
    )
    difference = float(re.search(r"logits against trainkit's: max difference ([\d.e+-]+)", result.stdout).group(1))
    assert difference < 1e-4 and "the same tokens: True" in result.stdout
    assert (tmp_path / "served" / "config.json").is_file()


def test_two_output_example_logs_keras_keys_and_learns():
    result = run_example_here("digits_two_heads.py", "--devices", "8", "--epochs", "10")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "logged digit_accuracy, digit_loss, even_accuracy, even_auc, even_loss, loss, val_digit_accuracy" in (
        result.stdout
    )
    accuracy, even, auc = map(
        float, re.search(r"digit accuracy ([\d.]+), even accuracy ([\d.]+), even AUC ([\d.]+)", result.stdout).groups()
    )
    assert accuracy >= 0.9 and even >= 0.85 and auc >= 0.9
    assert "predict returns ['digit', 'even'] with shapes [(360, 10), (360, 1)]" in result.stdout


def test_training_from_shards_through_grain_workers_resumes_bit_identical(tmp_path):
    pytest.importorskip("grain")
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "from_files.py"),
            "--data-dir",
            str(tmp_path),
            "--steps",
            "60",
            "--interrupt-at",
            "25",
            "--min-accuracy",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in tmp_path.glob("images-*.npy"))[-1] == "images-00007.npy"
    assert "interrupted: training preempted after step 25" in result.stdout
    assert "resumed and finished at step 60" in result.stdout
    assert "bit-identical to an uninterrupted run: True" in result.stdout
    assert "leaked shared_memory" not in result.stderr, result.stderr  # batches copied out of grain's buffers


@pytest.mark.parametrize("strategy", ["tp", "pipeline", "context"])
def test_the_language_model_example_trains_in_a_short_mode(strategy):
    """examples/lm.py for a few steps (its full-mode figure is in docs/large_models.md): the
    held-out bits per byte fall below the 8 of a uniform guess, and it reports tokens/s. (The
    same model under FSDP is tests/test_annotations.py's, against SingleDevice.)"""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # a process of its own: fully optimised, the
    # LM steps run faster than the suite's unoptimised ones repay the start (15.4 s against 16.8 s)
    command = [sys.executable, str(ROOT / "examples" / "lm.py"), "--strategy", strategy, "--steps", "20"]
    command += ["--layers", "2", "--d-model", "64", "--length", "64", "--corpus-bytes", "200000", "--verbose", "0"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    bits = float(re.search(r"held-out loss (\d+\.\d+) bits per byte after 20 steps", result.stdout).group(1))
    assert bits < 5.5, result.stdout
    assert re.search(r"[\d,]+ tokens/s", result.stdout)
    expected = {"tp": "mesh data=2, model=4", "pipeline": "mesh stage=2, data=4", "context": "mesh data=2, context=4"}
    assert expected[strategy] in result.stdout, result.stdout


def test_the_language_model_example_trains_packed_documents_alike_under_fsdp_and_a_context_axis():
    """``examples/lm.py --pack``: whole files packed into rows (segment ids, positions per document, the loss
    masked at boundaries) learn (below the 8 bits of a uniform guess) and reach the same held-out figure under
    FSDP and under Hybrid(data=2, context=4), whose attention splits the rows and their segment ids by hand."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    figures = {}
    for strategy in ("fsdp", "context"):
        command = [sys.executable, str(ROOT / "examples" / "lm.py"), "--pack", "--strategy", strategy, "--steps", "15"]
        command += ["--layers", "2", "--d-model", "64", "--length", "64", "--corpus-bytes", "200000", "--verbose", "0"]
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        assert re.search(r"\d+ training rows of \d+ packed files", result.stdout), result.stdout
        figures[strategy] = float(re.search(r"held-out loss (\d+\.\d+) bits per byte", result.stdout).group(1))
    assert figures["fsdp"] < 5.5 and figures["fsdp"] == figures["context"], figures


def test_the_language_model_example_runs_on_the_real_devices():
    """``--devices 0``: the machine's own devices (here one CPU; on a TPU machine the chip), no
    fake-device flag (it once passed ``--xla_force_host_platform_device_count=0``, and the CPU
    backend could not start)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS")}
    command = [sys.executable, str(ROOT / "examples" / "lm.py"), "--devices", "0", "--strategy", "single"]
    command += ["--steps", "3", "--layers", "1", "--d-model", "32", "--length", "32", "--corpus-bytes", "50000"]
    result = subprocess.run(command + ["--verbose", "0"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"held out\) on 1 cpu devices", result.stdout), result.stdout


def test_finetune_digits_compares_the_three_ways_and_keeps_the_adapter_checkpoint_small(tmp_path):
    pytest.importorskip("safetensors")
    # one device: the example's loading into FSDP is tested in test_weights.py; here its figures
    result = run_example_here("finetune_digits.py", "--strategy", "single", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {}
    for match in re.finditer(
        r"^(all weights|frozen body, new head|LoRA rank 2) +(\d\.\d+) +([\d,]+) +([\d,.]+) KiB", result.stdout, re.M
    ):
        rows[match.group(1)] = (
            float(match.group(2)),
            int(match.group(3).replace(",", "")),
            float(match.group(4).replace(",", "")),
        )
    assert set(rows) == {"all weights", "frozen body, new head", "LoRA rank 2"}, result.stdout
    full, frozen, lora = rows["all weights"], rows["frozen body, new head"], rows["LoRA rank 2"]
    assert full[0] >= 0.9 and lora[0] >= 0.9, result.stdout
    assert lora[1] < full[1] / 20 and frozen[1] < full[1] / 20  # trainable parameters
    assert lora[2] < full[2] / 20 and frozen[2] < full[2] / 20  # optimizer-state bytes
    share = float(re.search(r"for the full state \((\d+\.\d)%\)", result.stdout).group(1))
    assert share < 5.0, result.stdout
    gap = float(re.search(r"differ from the adapters' by at most ([\d.e+-]+)", result.stdout).group(1))
    # float32 reassociation: x @ (W + B A) against x @ W + (x @ B) @ A on logits of about 10
    # (7.6e-6 on jax 0.10, 2.1e-5 on jax 0.12); a wrong merge differs by whole units
    assert gap < 1e-4
    assert "kept at their initial values: head/bias, head/kernel" in result.stdout
    assert f"published as {tmp_path / 'digits0-4.safetensors'}" in result.stdout  # in --out, not a new temp dir


@pytest.mark.parametrize(
    "example", ["digits_cnn.py", "digits_two_heads.py", "from_files.py", "lm.py", "finetune_digits.py", "serve_gpt2.py"]
)
def test_every_example_s_help_shows_its_defaults(example):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example), "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    options = re.findall(r"^\s+(--[\w-]+) [A-Z_{]", result.stdout, re.M)  # options that take a value
    assert options, result.stdout
    for option in options:
        entry = text[text.index(option + " ", text.index("options:")) :]
        following = re.search(r" --[\w-]+ ", entry[len(option) :])
        entry = entry[: len(option) + (following.start() if following else len(entry))]
        assert "(default:" in entry, (option, entry)


@pytest.mark.parametrize(
    ("script", "args", "expected"),
    [
        ("vae.py", ("--strategy", "dp", "--epochs", "15", "--min-gain", "0.25"), r"last epoch: \{'kl_loss'.*'val_"),
        ("gan.py", ("--strategy", "dp", "--epochs", "10"), r"d_loss \d\.\d+, g_loss \d\.\d+"),
        ("distillation.py", ("--strategy", "fsdp", "--teacher-epochs", "5", "--epochs", "5"), r"as the trainer: True"),
    ],
    ids=["vae", "gan", "distillation"],
)
def test_custom_training_examples_run_on_8_devices(script, args, expected):
    result = run_example_here(script, "--devices", "8", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(expected, result.stdout), result.stdout
