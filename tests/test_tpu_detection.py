"""A TPU machine without GCE's metadata server (a container, an air-gapped VM): JAX's cloud-TPU
detection is simulated on CPU (its "running on a Cloud TPU VM" flag set, the metadata server an
address nothing listens on). A single-host slice (v5litepod-1) trains with one line said; a
multi-host one (v5litepod-16) is refused by name before anything is built; the real detection runs
and fails as it would on such a machine (requests' ConnectionError)."""

import os
import subprocess
import sys
import time

import numpy as np
import optax
import pytest
from flax import linen as nn
from jax._src import cloud_tpu_init
from jax._src.clusters import cloud_tpu_cluster

import trainkit as tk
from trainkit.distributed import JobError, processes, tpu_slice

#: where a container without the metadata route sends JAX's metadata queries: refused at once
NO_METADATA = "127.0.0.1:9"
TPU_VARIABLES = (*tpu_slice.SLICE_VARIABLES, "TPU_SKIP_MDS_QUERY")


@pytest.fixture
def tpu_vm(monkeypatch):
    """This process as JAX sees a Cloud TPU VM, with no metadata server; the job asked afresh."""
    monkeypatch.setattr(cloud_tpu_init, "running_in_cloud_tpu_vm", True)
    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", True)  # the module's own copy
    monkeypatch.setenv("GCE_METADATA_IP", NO_METADATA)
    for name in TPU_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    processes._tpu_pod_job.cache_clear()
    yield monkeypatch
    processes._tpu_pod_job.cache_clear()


def fit_once() -> float:
    x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    trainer = tk.Trainer(nn.Dense(1), loss="mse", optimizer=optax.sgd(0.1), strategy="single")
    return float(trainer.fit(x, x[:, :1], batch_size=8, verbose=0).history["loss"][-1])


@pytest.mark.parametrize(
    "env, hosts",
    [
        ({"TPU_ACCELERATOR_TYPE": "v5litepod-1"}, 1),
        ({"TPU_ACCELERATOR_TYPE": "v5litepod-8"}, 1),
        ({"TPU_ACCELERATOR_TYPE": "v5litepod-16"}, 4),
        ({"TPU_ACCELERATOR_TYPE": "v6e-256"}, 64),
        ({"TPU_ACCELERATOR_TYPE": "v4-32"}, 4),
        ({"TPU_ACCELERATOR_TYPE": "v5p-8"}, 1),
        ({"TPU_HOST_BOUNDS": "1,1,1", "TPU_ACCELERATOR_TYPE": "v4-32"}, 1),
        ({"TPU_HOST_BOUNDS": "2,2,1"}, 4),
        ({"TPU_WORKER_HOSTNAMES": "a,b,c,d", "MEGASCALE_NUM_SLICES": "2"}, 8),
        ({"MEGASCALE_COORDINATOR_ADDRESS": "host0:8080"}, 2),
        ({"TPU_ACCELERATOR_TYPE": "tpu-next-gen"}, None),
        ({}, None),
    ],
)
def test_hosts_read_from_the_environment(env, hosts):
    assert tpu_slice.hosts(env) == hosts


def test_a_single_host_slice_without_metadata_trains_without_asking(tpu_vm):
    tpu_vm.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-1")
    asked = []
    tpu_vm.setattr(processes, "_jax_tpu_job", lambda: asked.append(1))
    assert processes.job() is None
    assert np.isfinite(fit_once())
    assert asked == []  # the metadata server is never asked on a single host


def test_a_machine_the_environment_does_not_describe_trains_alone_with_one_line(tpu_vm, capfd):
    assert not tpu_slice.metadata_reachable()
    assert processes.job() is None
    assert np.isfinite(fit_once())
    said = [line for line in capfd.readouterr().err.splitlines() if "metadata server" in line]
    assert len(said) == 1 and "this host trains alone" in said[0]


def test_a_multi_host_slice_without_metadata_is_refused_by_name(tpu_vm):
    tpu_vm.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-16")
    with pytest.raises(JobError, match=r"one of 4 hosts .*TPU_ACCELERATOR_TYPE=v5litepod-16.*ConnectionError") as info:
        tk.Trainer(nn.Dense(1), loss="mse", optimizer=optax.sgd(0.1), strategy="single")
    assert "TPU_WORKER_HOSTNAMES" in str(info.value) and "TRAINKIT_DISTRIBUTED=off" in str(info.value)


def test_a_multi_host_slice_trains_alone_when_asked(tpu_vm):
    tpu_vm.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-16")
    tpu_vm.setenv("TRAINKIT_DISTRIBUTED", "off")
    assert processes.job() is None
    assert np.isfinite(fit_once())


# ---------------------------------------------------------------- #81: a slice the environment describes whole
SLICE = {"TPU_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.1", "TPU_WORKER_ID": "1", "MEGASCALE_NUM_SLICES": "1"}


def test_a_slice_the_environment_describes_is_joined_without_jax_detection(tpu_vm):
    """TP9: with the worker list and this host's id set (MEGASCALE_NUM_SLICES=1 too), JAX's detection
    queried the metadata server anyway (a raw ConnectionError); now the job is read from the variables."""
    for name, value in SLICE.items():
        tpu_vm.setenv(name, value)
    asked = []
    tpu_vm.setattr(processes, "_jax_tpu_job", lambda: asked.append(1))
    found = processes.job()
    assert (found.engine, found.num_processes, found.process_id) == ("tpu", 2, 1)
    assert found.coordinator_address == f"127.0.0.1:{tpu_slice.COORDINATOR_PORT}" and found.detection == "deactivate"
    assert asked == []


@pytest.mark.parametrize(
    "changes, says",
    [
        ({"TPU_WORKER_ID": "abc"}, r"TPU_WORKER_ID='abc' is not a non-negative integer"),
        ({"TPU_WORKER_ID": "2"}, r"TPU_WORKER_ID=2 is past the 2 workers of TPU_WORKER_HOSTNAMES"),
        ({"TPU_WORKER_ID": ""}, r"TPU_WORKER_ID \(this host's place\) is not set"),
        ({"MEGASCALE_NUM_SLICES": "0"}, r"MEGASCALE_NUM_SLICES='0' is not a positive integer"),
        ({"TPU_ACCELERATOR_TYPE": "v5litepod-16"}, r"lists 2 workers, but the accelerator type 'v5litepod-16' has 4"),
        ({"TPU_WORKER_HOSTNAMES": "no-such-host.invalid,b"}, r"no-such-host.invalid:8482 .* does not resolve"),
    ],
    ids=["id-not-a-number", "id-past-the-list", "id-missing", "no-slices", "contradicting-type", "unresolvable"],
)
def test_a_slice_described_wrongly_is_named_at_once(tpu_vm, changes, says):
    """TP9 / TP10 / TP4: int('abc'), JAX's ValueError, a silent lone run or a 43 s wait before; now a JobError
    naming the variable and its value, before anything is built and without a metadata query."""
    for name, value in (SLICE | changes).items():
        tpu_vm.setenv(name, value)
    start = time.monotonic()
    with pytest.raises(JobError, match=says):
        processes.job()
    assert time.monotonic() - start < 5


TPU_JOIN = """
from jax._src import cloud_tpu_init
from jax._src.clusters import cloud_tpu_cluster
cloud_tpu_init.running_in_cloud_tpu_vm = cloud_tpu_cluster.running_in_cloud_tpu_vm = True
import trainkit.distributed as d
d.initialize()
"""


def test_a_slice_whose_peer_never_comes_ends_within_the_join_bound():
    """TP9: a C++ SIGABRT at 48 s before (TRAINKIT_JOIN_TIMEOUT was not applied on the TPU path)."""
    from trainkit.distributed.joining import JOIN_FAILED

    env = {k: v for k, v in os.environ.items() if k not in TPU_VARIABLES and k != "XLA_FLAGS"}
    env |= SLICE | {"TRAINKIT_JOIN_TIMEOUT": "2", "JAX_PLATFORMS": "cpu", "GCE_METADATA_IP": NO_METADATA}
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", TPU_JOIN], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == JOIN_FAILED, result.stderr[-2000:]
    assert "trainkit: this process (1 of 2, tpu) waited 2 s to join the job" in result.stderr, result.stderr[-2000:]
    assert time.monotonic() - start < 2 + 45  # the bound, and a loaded machine's Python and JAX start


def test_a_worker_list_of_this_host_alone_needs_no_id(tpu_vm):
    """A single-host VM may list itself (``TPU_WORKER_HOSTNAMES=localhost``, as compile-only targets set it)."""
    tpu_vm.setenv("TPU_WORKER_HOSTNAMES", "localhost")
    assert processes.job() is None
