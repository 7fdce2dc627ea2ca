"""Published weights in and out (``tk.weights.load``, ``trainer.save_weights``): torch models
saved with ``safetensors.torch`` give torch's outputs once loaded; the strict report names each
problem; every strategy places the same values, each device holding only its shard."""

import os
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import classifier
from safetensors.numpy import save_file as save_numpy

import trainkit as tk

try:  # the torch models need torch (CI installs its CPU wheel on Python 3.11); the rest does not
    import torch
    from safetensors.torch import save_file
except ImportError:
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

TOKENS, CLASSES = 10, 3


class TorchMLP(torch.nn.Module if torch else object):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(5, 16), torch.nn.Linear(16, CLASSES)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class FlaxMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(CLASSES, name="fc2")(nn.relu(nn.Dense(16, name="fc1")(x)))


class TorchNet(torch.nn.Module if torch else object):
    """Embedding -> Conv2d -> BatchNorm2d -> mean over space -> LayerNorm -> Linear."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(TOKENS, 4)
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.ln = torch.nn.LayerNorm(8)
        self.fc = torch.nn.Linear(8, CLASSES)

    def forward(self, tokens):
        x = self.embed(tokens).permute(0, 3, 1, 2)  # NHWC -> NCHW
        x = torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3))
        return self.fc(self.ln(x))


class FlaxNet(nn.Module):
    """The same network in Flax (NHWC; the spatial mean makes the flatten order moot)."""

    classes: int = CLASSES

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        x = nn.Embed(TOKENS, 4, name="embed")(tokens)
        x = nn.Conv(8, (3, 3), padding=1, name="conv")(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, name="bn")(x)
        x = nn.relu(x).mean(axis=(1, 2))
        return nn.Dense(self.classes, name="fc")(nn.LayerNorm(epsilon=1e-5, name="ln")(x))


def tokens(n=16, seed=0):
    return np.random.default_rng(seed).integers(0, TOKENS, (n, 6, 6)).astype(np.int32)


@pytest.fixture(scope="module")
def torch_net(tmp_path_factory):
    """A TorchNet with trained-looking BatchNorm statistics, saved with safetensors.torch."""
    torch.manual_seed(0)
    net = TorchNet()
    with torch.no_grad():
        net.train()
        for seed in range(3):  # running statistics that differ from (0, 1)
            net(torch.from_numpy(tokens(32, seed + 10)).long())
        net.eval()
    path = str(tmp_path_factory.mktemp("torch") / "net.safetensors")
    save_file(net.state_dict(), path)
    return net, path


def trainer_for(model, strategy="single"):
    return classifier(model, optimizer=optax.adam(1e-3), strategy=strategy)


def torch_outputs(net, x):
    with torch.no_grad():
        return net(torch.from_numpy(x).long() if x.dtype == np.int32 else torch.from_numpy(x)).numpy()


@needs_torch
def test_a_state_dict_of_torch_tensors_loads_as_its_file_does():
    torch.manual_seed(1)
    net = TorchMLP().eval()
    x = np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32)
    trainer = trainer_for(FlaxMLP())
    trainer.init(x)
    report = tk.weights.load(net.state_dict(), into=trainer, layout="torch")  # tensors, not arrays
    assert report.loaded == ("fc1/bias", "fc1/kernel", "fc2/bias", "fc2/kernel")
    np.testing.assert_allclose(trainer.predict(x), torch_outputs(net, x), atol=1e-5)
    bf16 = {name: tensor.to(torch.bfloat16) for name, tensor in net.state_dict().items()}
    into = {"fc1": {"kernel": np.zeros((5, 16), np.float32)}}
    loaded = tk.weights.load(bf16, into=into, layout="torch", strict=False)
    expected = net.state_dict()["fc1.weight"].to(torch.bfloat16).float().numpy().T
    np.testing.assert_array_equal(loaded.tree["fc1"]["kernel"], expected)


@needs_torch
def test_a_torch_mlp_gives_torchs_outputs(tmp_path):
    torch.manual_seed(1)
    net = TorchMLP().eval()
    save_file(net.state_dict(), tmp_path / "mlp.safetensors")
    x = np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32)
    trainer = trainer_for(FlaxMLP())
    trainer.init(x)
    report = tk.weights.load(tmp_path / "mlp.safetensors", into=trainer, layout="torch")
    assert report.loaded == ("fc1/bias", "fc1/kernel", "fc2/bias", "fc2/kernel")
    np.testing.assert_allclose(trainer.predict(x), torch_outputs(net, x), atol=1e-5)


@needs_torch
def test_a_torch_cnn_with_batchnorm_layernorm_and_embedding_gives_torchs_outputs(torch_net):
    net, path = torch_net
    x = tokens()
    trainer = trainer_for(FlaxNet())
    trainer.init(x)
    report = tk.weights.load(path, into=trainer, layout="torch")
    assert report.ignored == ("bn.num_batches_tracked",)
    assert "batch_stats/bn/mean" in report.loaded and not report.missing
    np.testing.assert_allclose(trainer.predict(x), torch_outputs(net, x), atol=1e-5)


@needs_torch
def test_the_strict_report_names_a_renamed_a_missing_and_a_reshaped_parameter(torch_net, tmp_path):
    net, _ = torch_net
    entries = dict(net.state_dict())
    entries["norm.weight"] = entries.pop("ln.weight")  # renamed
    del entries["fc.bias"]  # missing
    entries["conv.bias"] = torch.zeros(7)  # reshaped
    save_file(entries, tmp_path / "broken.safetensors")
    trainer = trainer_for(FlaxNet())
    trainer.init(tokens())
    before = jax.tree.map(np.asarray, trainer.get_weights())
    with pytest.raises(ValueError) as error:
        tk.weights.load(tmp_path / "broken.safetensors", into=trainer, layout="torch")
    lines = str(error.value).splitlines()
    assert "  not in the model: norm.weight" in lines
    assert "  missing from the source: ln/scale" in lines
    assert "  missing from the source: fc/bias" in lines
    assert "  conv/bias: shape (7,) in the source (as stored), (8,) in the model" in lines
    assert "nothing was loaded" in lines[0]
    after = jax.tree.map(np.asarray, trainer.get_weights())
    jax.tree.map(np.testing.assert_array_equal, before, after)
    # the renamed entry mapped back, the others named as not strict: loads what matches
    report = tk.weights.load(
        tmp_path / "broken.safetensors", into=trainer, layout="torch", rename=[(r"^norm\.", "ln.")], strict=False
    )
    assert report.missing == ("fc/bias",) and "ln/scale" in report.loaded


@needs_torch
def test_keep_initial_leaves_a_new_head_at_its_initial_values(torch_net):
    net, path = torch_net
    trainer = trainer_for(FlaxNet(classes=5))  # a new head: 5 classes where the source has 3
    trainer.init(tokens())
    initial = trainer.get_weights()["params"]["fc"]["kernel"].copy()
    with pytest.raises(ValueError, match=r"fc/kernel: shape \(3, 8\) in the source \(as stored\), \(8, 5\)"):
        tk.weights.load(path, into=trainer, layout="torch")
    report = tk.weights.load(path, into=trainer, layout="torch", keep_initial=[r"^fc/"])
    assert sorted(report.kept_initial) == ["fc/bias", "fc/kernel"] and not report.missing
    np.testing.assert_array_equal(trainer.get_weights()["params"]["fc"]["kernel"], initial)
    np.testing.assert_array_equal(trainer.get_weights()["params"]["ln"]["scale"], net.ln.weight.detach().numpy())


def test_a_prefix_mismatch_gets_a_rename_hint(tmp_path):
    params = {"params": {"fc1": {"kernel": np.ones((5, 16), np.float32), "bias": np.ones(16, np.float32)}}}
    trainer = trainer_for(FlaxMLP())
    trainer.init(np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match=r"try rename=\[\('\^params/', ''\)\]"):
        tk.weights.load(params, into=trainer)


@needs_torch
@pytest.mark.parametrize("strategy", ["fsdp", "dp", "hybrid"])
def test_every_strategy_places_the_values_of_one_device_each_holding_its_shard(torch_net, strategy):
    net, path = torch_net
    x = tokens(16)
    single = trainer_for(FlaxNet())
    single.init(x)
    tk.weights.load(path, into=single, layout="torch")
    strategies = {"fsdp": lambda: tk.FSDP(min_shard_size=1), "dp": tk.DataParallel}
    strategies["hybrid"] = lambda: tk.Hybrid(data=2, fsdp=4, min_shard_size=1)
    sharded = trainer_for(FlaxNet(), strategy=strategies[strategy]())
    sharded.init(x)
    tk.weights.load(path, into=sharded, layout="torch")
    jax.tree.map(np.testing.assert_array_equal, single.get_weights(), sharded.get_weights())
    # the same weights; the outputs as close as the suite's other cross-strategy comparisons (one device's batch of 16
    # and 8 devices' batches of 2 round differently: 1.6e-6 with today's packages)
    np.testing.assert_allclose(sharded.predict(x), single.predict(x), rtol=2e-5, atol=2e-6)
    kernel = sharded.state.params["conv"]["kernel"]
    shard_bytes = {s.data.nbytes for s in kernel.addressable_shards}
    assert shard_bytes == {np.prod(kernel.sharding.shard_shape(kernel.shape)) * kernel.dtype.itemsize}
    assert (max(shard_bytes) < kernel.nbytes) == (strategy != "dp")  # DataParallel replicates


def test_a_source_reads_only_the_shard_a_device_asks_for(tmp_path, monkeypatch):
    """The bytes read from a safetensors file for a device are its shard's (memory-mapped slices)."""
    from trainkit.weights.sources import SafetensorsSource

    save_numpy({"w": np.arange(64 * 8, dtype=np.float32).reshape(64, 8)}, tmp_path / "w.safetensors")
    reads, original = [], SafetensorsSource.read

    def read(self, name, index):
        reads.append(original(self, name, index))
        return reads[-1]

    monkeypatch.setattr(SafetensorsSource, "read", read)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    abstract = {"w": jax.ShapeDtypeStruct((64, 8), jnp.float32, sharding=sharding)}
    loaded = tk.weights.load(tmp_path / "w.safetensors", into=abstract)
    assert sorted(r.shape for r in reads) == [(8, 8)] * 8
    np.testing.assert_array_equal(np.asarray(loaded.tree["w"]), np.arange(64 * 8).reshape(64, 8))


def test_bf16_safetensors_are_read_and_their_cast_reported(tmp_path):
    save_numpy({"w": np.ones((4, 2), ml_dtypes.bfloat16)}, tmp_path / "bf16.safetensors")
    loaded = tk.weights.load(tmp_path / "bf16.safetensors", into={"w": np.zeros((4, 2), np.float32)})
    assert loaded.report.casts == (("w", "bfloat16", "float32"),) and not loaded.report.lossy
    assert loaded.tree["w"].dtype == np.float32 and loaded.tree["w"].sum() == 8
    with pytest.raises(ValueError, match="w: float32 in the source loses values as bfloat16"):
        tk.weights.load({"w": np.ones((4, 2), np.float32)}, into={"w": np.zeros((4, 2), ml_dtypes.bfloat16)})


def test_orbax_and_npz_sources_load_into_a_sharded_tree(tmp_path):
    params = {"fc1": {"kernel": np.arange(80.0, dtype=np.float32).reshape(5, 16), "bias": np.ones(16, np.float32)}}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(str(tmp_path / "orbax"), params)
    checkpointer.wait_until_finished()
    np.savez(tmp_path / "p.npz", **{"fc1/kernel": params["fc1"]["kernel"], "fc1/bias": params["fc1"]["bias"]})
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "fsdp"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=split if a.ndim == 2 else replicated), params
    )
    for source in (tmp_path / "orbax", tmp_path / "p.npz"):
        loaded = tk.weights.load(source, into=abstract).tree
        assert loaded["fc1"]["kernel"].sharding == split
        np.testing.assert_array_equal(np.asarray(loaded["fc1"]["kernel"]), params["fc1"]["kernel"])


@needs_torch
def test_save_weights_in_torch_layout_loads_into_the_torch_model_strictly(torch_net, tmp_path):
    net, path = torch_net
    x = tokens()
    trainer = trainer_for(FlaxNet())
    trainer.init(x)
    tk.weights.load(path, into=trainer, layout="torch")
    trainer.fit(x, np.arange(16) % CLASSES, batch_size=8, epochs=1, verbose=0)  # weights of its own
    trainer.save_weights(tmp_path / "out.safetensors", layout="torch")
    fresh = TorchNet().eval()
    from safetensors.torch import load_file

    fresh.load_state_dict(load_file(tmp_path / "out.safetensors"), strict=True)
    np.testing.assert_allclose(torch_outputs(fresh, x), trainer.predict(x), atol=1e-5)
    # and the Flax layout reads back as numpy, name for name
    trainer.save_weights(tmp_path / "flax.safetensors")
    from safetensors.numpy import load_file as load_numpy

    written = load_numpy(tmp_path / "flax.safetensors")
    np.testing.assert_array_equal(written["conv/kernel"], trainer.get_weights()["params"]["conv"]["kernel"])
    assert sorted(os.listdir(tmp_path)) == ["flax.safetensors", "out.safetensors"]  # no staging left


def test_load_refuses_what_it_cannot_take(tmp_path):
    with pytest.raises(FileNotFoundError, match="No weights at"):
        tk.weights.load(tmp_path / "nothing.safetensors", into={})
    with pytest.raises(TypeError, match="into= takes a trainkit.Trainer or a tree"):
        tk.weights.load({"w": np.ones(2)}, into=[np.ones(2)])
    with pytest.raises(ValueError, match="layout='keras' is not one of"):
        tk.weights.load({"w": np.ones(2)}, into={"w": np.ones(2)}, layout="keras")


def test_two_processes_load_the_values_of_one_each_reading_only_its_shards(tmp_path):
    """2 processes x 4 devices (gloo) load the file's values (one process's, tested above);
    each process reads from the file exactly the bytes its devices hold."""
    import json
    import re
    import subprocess
    import sys

    from conftest import subprocess_cache_env

    rng = np.random.default_rng(0)
    entries = {"hidden/kernel": rng.normal(size=(64, 256)), "hidden/bias": rng.normal(size=256)}
    entries |= {"head/kernel": rng.normal(size=(256, 8)), "head/bias": rng.normal(size=8)}
    save_numpy({k: v.astype(np.float32) for k, v in entries.items()}, tmp_path / "w.safetensors")
    script = pathlib.Path(__file__).parent / "scripts" / "multihost_weights.py"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env |= subprocess_cache_env(processes=2)
    for nproc, devices in ((2, 4),):  # the values of one process are the file's, compared below
        out = tmp_path / f"{nproc}.npz"
        command = [sys.executable, "-m", "trainkit.launch", "--nproc", str(nproc), "--devices-per-proc", str(devices)]
        result = subprocess.run(
            [*command, str(script), str(tmp_path / "w.safetensors"), str(out)],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        counts = [json.loads(m) for m in re.findall(r"process \d+: (\{.*\})", result.stdout)]
        assert len(counts) == nproc and all(c["read"] == c["held"] for c in counts), result.stdout
        with np.load(out) as loaded:
            for name, value in entries.items():
                module, leaf = name.split("/")
                np.testing.assert_array_equal(loaded[f"['params']['{module}']['{leaf}']"], value.astype(np.float32))
    total = sum(v.size * 4 for v in entries.values())
    assert counts[0]["held"] < total  # sharded: each process holds part of it
