"""The Python blocks of the user guides run as written (porting_from_keras.md's in
tests/test_ports.py, which compares what it trains with Keras)."""

import pathlib

import pytest
from conftest import run_guide

DOCS = pathlib.Path(__file__).parent.parent / "docs"


@pytest.mark.parametrize(
    "page",
    [
        "quickstart.md",
        "outputs.md",
        "data.md",
        "monitoring.md",
        "callbacks.md",
        "strategies.md",
        "precision_and_memory.md",
        "checkpointing.md",
        "troubleshooting.md",
        "large_models.md",
        "export.md",
        "tuning.md",
        "finetuning.md",
        "targets.md",
        "custom_training.md",
    ],
)
def test_guide_code_runs(page):
    if page == "targets.md":
        pytest.importorskip("libtpu", reason="the tpu-plan extra is not installed")
    namespace = run_guide(DOCS / page)
    assert namespace.get("trainer") is not None and namespace["trainer"].state is not None
