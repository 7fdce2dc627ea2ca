"""The chip's own tests (``make test-tpu``): run in ONE process on a machine with an accelerator (a
TPU admits one process: no ``-n``, no subprocess opening it while these hold it), skipped elsewhere.

``make test-tpu`` runs them with ``--confcutdir=tests/accelerator``, so ``tests/conftest.py`` (8
fake CPU devices) is not loaded and JAX finds the machine's own devices. Inside ``make test`` they
are collected under the fake CPU devices and skip. ``TRAINKIT_ACCELERATOR_TESTS=cpu`` runs them on
the CPU (a rehearsal of the suite itself, where no chip is lent)."""

import os

import jax
import pytest

#: where the chip's tests run: the first device, when it is an accelerator (or a CPU asked for)
REHEARSAL = os.environ.get("TRAINKIT_ACCELERATOR_TESTS") == "cpu"
ON_ACCELERATOR = jax.devices()[0].platform != "cpu"


def pytest_collection_modifyitems(items):
    if ON_ACCELERATOR or REHEARSAL:
        return
    skip = pytest.mark.skip(reason="needs an accelerator: make test-tpu on a TPU machine")
    for item in items:
        if "accelerator" in item.path.parts:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def chip():
    """The accelerator the tests train on (the first device)."""
    return jax.devices()[0]


@pytest.fixture(scope="session")
def host_cpu():
    """This process's CPU, beside the chip: the reference the chip's numbers are compared with."""
    return jax.devices("cpu")[0]
