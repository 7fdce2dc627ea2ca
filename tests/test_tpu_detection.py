"""A TPU machine without GCE's metadata server (a container, an air-gapped VM): JAX's cloud-TPU
detection is simulated on CPU (its "running on a Cloud TPU VM" flag set, the metadata server an
address nothing listens on). A single-host slice (v5litepod-1) trains with one line said; a
multi-host one (v5litepod-16) is refused by name before anything is built; the real detection runs
and fails as it would on such a machine (requests' ConnectionError)."""

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
