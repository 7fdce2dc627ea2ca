"""Fakes 8 CPU devices before JAX is imported; shared tiny models and data."""

import contextlib
import importlib.metadata
import importlib.util
import io
import linecache
import os
import pathlib
import re
import typing

#: XLA:CPU's backend without its LLVM optimisation passes: the suite's tiny programs compile in
#: about 0.7 of the time (measured on test_keras_fit_semantics + test_sharded: 86.6 -> 68.8 s) and
#: compute the same results (the same HLO; every comparison of the suite passes either way).
#: Benchmarks, examples and `make example` run fully optimised; only the tests set it.
TEST_XLA_FLAGS = ["--xla_backend_optimization_level=0"]


def _jaxlib_version() -> tuple[int, ...]:
    """The installed jaxlib's version, read without importing JAX (its flags are read at import)."""
    release = importlib.metadata.version("jaxlib").split("+")[0].split(".")
    return tuple(int(part) for part in release[:3] if part.isdigit())


#: jaxlib 0.10's CPU emitters of before its MLIR fusion emitters: the suite compiles in about 0.66 of the CPU
#: (docs/performance.md, "Where the test suite's time goes"), every result the same. jaxlib 0.12 has only the
#: new emitters and refuses the flag (CI's Python 3.12 run tests those).
if (0, 10) <= _jaxlib_version() < (0, 11):
    TEST_XLA_FLAGS.append("--xla_cpu_use_fusion_emitters=false")
#: XLA:CPU runs the 8 fake devices' programs on a thread pool sized by the machine's cores: a collective waits
#: on a pool thread for its peers, and when every thread waits, a device whose turn never comes hangs the others
#: until XLA aborts the process ("Termination timeout for `all reduce RendezvousKey...`"). The pipeline's step,
#: whose loop of all-to-alls runs beside an all-reduce, did so in 2 of 17 runs with the emitters above on this
#: 2-core machine, in none of 30 with the pool XLA sizes by NPROC instead (docs/performance.md).
os.environ["NPROC"] = "32"
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8", *TEST_XLA_FLAGS]
)
#: the tests' compiler flags as a child process takes them: without the device count (the child sets its own)
CHILD_XLA_FLAGS = " ".join(TEST_XLA_FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Hermetic runs: no compiled step comes from an earlier run (tests/test_compile.py turns it on).
os.environ.setdefault("TRAINKIT_COMPILATION_CACHE", "off")
os.environ["KERAS_BACKEND"] = "jax"  # the Keras side-by-side tests (keras is a dev extra)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

assert len(jax.devices()) == 8, "tests need 8 fake CPU devices (set before jax is imported)"

# One persistent compilation cache per test process, new each run: the many tests that compile
# the same small programs load them after the first compile (the suite's largest cost), and no
# compiled step comes from an earlier run. trainkit's own cache setting stays "off" above, so
# "auto" remembers no pick across tests (see `shared_compilation_cache`).
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from jax._src import compilation_cache as jax_compilation_cache  # noqa: E402

#: "" in a process multiprocessing spawned: a data worker (grain's, torch's) that imported a test
#: module to unpickle a source defined there compiles nothing and would leave the directory behind.
#: (A directory shared by both xdist workers saved nothing measurable: their files compile different programs.)
COMPILATION_CACHE = ""
if "--multiprocessing-fork" not in sys.orig_argv:
    COMPILATION_CACHE = tempfile.mkdtemp(prefix="trainkit-tests-jax-cache-")
    jax.config.update("jax_compilation_cache_dir", COMPILATION_CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

#: modules that count compiles or set up compilation caches of their own: no shared cache there
OWN_COMPILATION_CACHE = {"test_compile", "test_auto_reproducible"}


def subprocess_cache_env(processes: int = 1) -> dict[str, str]:
    """Environment entries that give a test's child processes this process's compiler flags and,
    for a job of one process, its compilation cache (its trainers compile the programs this one
    did); for tests whose children use no "auto" decision (a cache given to JAX also holds the
    remembered picks). A job of several CPU processes gets no cache: trainkit would turn it off
    with a warning (trainkit/distributed/compile_cache.py says why)."""
    flags = {"XLA_FLAGS": CHILD_XLA_FLAGS}
    if processes > 1:
        return flags
    return flags | {"JAX_COMPILATION_CACHE_DIR": COMPILATION_CACHE, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


#: what JAX's CUDA plugin (the gpu-plan extra) prints on stderr at `import jax` on a machine
#: without a GPU; no setting silences it (TF_CPP_MIN_LOG_LEVEL, GLOG_minloglevel tried)
_CUDA_PLUGIN_NOISE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|[IW]\d{4} [\d:. ]+\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers.*)$"
)


def own_stderr_lines(stderr: str) -> list[str]:
    """The lines of a child's stderr that trainkit (or Python) wrote: without the CUDA plugin's
    start-up notice, which CI's environment (with the gpu-plan extra) prints in every process."""
    return [line for line in stderr.strip().splitlines() if not _CUDA_PLUGIN_NOISE.match(line)]


class MLP(nn.Module):
    """A small deterministic classifier."""

    features: int = 16
    classes: int = 3

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.features)(x))
        return nn.Dense(self.classes)(x)


class NoisyMLP(nn.Module):
    """MLP with BatchNorm and Dropout (the design's standard test model). ``dense_bias=False`` leaves out
    the bias before the BatchNorm, as real networks are written: BatchNorm subtracts the batch mean, so that
    bias's gradient is zero but for rounding, which Adam scales into full steps (a comparison of two
    compiled forms of one step would weigh noise there)."""

    dense_bias: bool = True

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(16, use_bias=self.dense_bias)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        x = nn.Dropout(0.2, deterministic=not train)(x)
        return nn.Dense(3)(x)


class Wide(nn.Module):
    """64 -> 256 -> 256 -> 8: large enough for FSDP's default min_shard_size to split it."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(256)(x))
        x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(8)(x)


class PairInputs(nn.Module):
    """A model of two inputs, given as a tuple or list: a Dense of each (``first``, ``second``), summed."""

    classes: int = 3

    @nn.compact
    def __call__(self, inputs):
        first, second = inputs
        return nn.Dense(self.classes, name="first")(first) + nn.Dense(self.classes, name="second")(second)


def classifier(model=None, *, optimizer=None, strategy="single", **options):
    """The suite's common trainer: ``model`` (an :class:`MLP` by default) trained on sparse
    categorical cross-entropy with ``optimizer`` (Adam at 0.05 by default) under ``strategy``;
    ``options``: the other ``Trainer`` arguments. A test file binds its own defaults with
    ``functools.partial``."""
    import trainkit as tk

    return tk.Trainer(
        MLP() if model is None else model,
        loss="sparse_categorical_crossentropy",
        optimizer=optax.adam(0.05) if optimizer is None else optimizer,
        strategy=strategy,
        **options,
    )


def make_classification(n: int, features: int = 5, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5)).astype(np.int32)
    return x, y


@pytest.fixture(scope="session")
def data():
    """100 rows: with batch 16 the last batch holds 4 real rows (ragged)."""
    return make_classification(100)


def strategy_table(min_shard_size: int, *, dp4: bool = False, model_rules=None) -> dict:
    """The suite's strategies by name, each a function that builds it (a strategy holds devices:
    one per test): one device, data parallel on 8 (and ``dp4``: on 4), FSDP on 8 and a 2 x 4
    Hybrid of data x FSDP (leaves of ``min_shard_size`` elements and more sharded), and with
    ``model_rules`` a 2 x 4 Hybrid of data x model. Every strategy is checked against "single"."""
    import trainkit as tk  # here: the conftest sets JAX's and trainkit's environment before trainkit is imported

    table = {"single": lambda: tk.SingleDevice(), "dp8": lambda: tk.DataParallel()}
    if dp4:
        table["dp4"] = lambda: tk.DataParallel(jax.devices()[:4])
    table["fsdp8"] = lambda: tk.FSDP(min_shard_size=min_shard_size)
    table["hybrid2x4_fsdp"] = lambda: tk.Hybrid(data=2, fsdp=4, min_shard_size=min_shard_size)
    if model_rules is not None:
        table["hybrid2x4_model"] = lambda: tk.Hybrid(data=2, model=4, rules=model_rules)
    return table


def check_trains_like_single_device(make, strategy, x, y, batch_size, steps):
    """``make(strategy)`` fits one epoch of ``steps`` steps to SingleDevice's losses (rtol 1e-5) and weights
    (atol 1e-5)."""
    results = []
    for chosen in ("single", strategy):
        trainer = make(chosen)
        history = trainer.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0).history
        results.append((history["loss"], jax.tree.leaves(trainer.get_weights()), trainer.global_step))
    (loss, weights, single_steps), (their_loss, their_weights, their_steps) = results
    assert single_steps == their_steps == steps
    np.testing.assert_allclose(their_loss, loss, rtol=1e-5)
    for ours, theirs in zip(their_weights, weights, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-5)


def check_resumes_and_loads_elsewhere(make, strategy, x, y, batch_size, checkpoint):
    """Trainers ``make(strategy)``: one epoch saved to ``checkpoint``, loaded into a new trainer and trained a
    second epoch, gives the weights of two epochs straight, bit for bit; the checkpoint loads onto SingleDevice
    and FSDP with the same weights (a layout-changing strategy saves the model's own layout)."""
    import trainkit as tk  # here: the conftest sets JAX's and trainkit's environment before trainkit is imported

    straight = make(strategy())
    straight.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    first = make(strategy())
    first.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    first.save(checkpoint)
    resumed = make(strategy())
    resumed.init(x[:1])
    resumed.load(checkpoint)
    resumed.fit(x, y, batch_size=batch_size, epochs=2, initial_epoch=1, shuffle=False, verbose=0)
    pairs = [(resumed, straight)]
    for other_strategy in ("single", tk.FSDP(min_shard_size=1)):
        other = make(other_strategy)
        other.init(x[:1])
        other.load(checkpoint)
        pairs.append((other, first))
    for ours, theirs in pairs:
        for a, b in zip(jax.tree.leaves(ours.get_weights()), jax.tree.leaves(theirs.get_weights()), strict=True):
            np.testing.assert_array_equal(a, b)


def attention_written_out(q, k, v):
    """Causal attention as einsums and a softmax on ``(batch, length, heads, head_dim)``: nothing
    trainkit can reach to split over a context axis (the compiler gathers what it needs)."""
    t = q.shape[1]
    logits = jax.numpy.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    logits = jax.numpy.where(np.tril(np.ones((t, t), bool)), logits, -1e9)
    return jax.numpy.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v)


EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def load_example(name: str, prefix: str = "example"):
    """``examples/<name>.py`` imported as a module of its own, ``<prefix>_<name>`` (run afresh)."""
    spec = importlib.util.spec_from_file_location(f"{prefix}_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses (linen modules) look their module up
    spec.loader.exec_module(module)
    return module


class ExampleRun(typing.NamedTuple):
    """What an example run gives, as ``subprocess.run`` does."""

    returncode: int
    stdout: str
    stderr: str


def run_example_here(script: str, *args: str) -> ExampleRun:
    """``examples/<script> args...`` in this test process, by its ``main(argv)``: on the 8 fake devices
    JAX already has (``--devices 8`` runs as ``--devices 0``, the devices there are), through the suite's
    compilation cache, its output captured and the environment variables it sets put back. For the runs
    that need no fresh process (``make example``, the examples' ``--help`` and a run on the machine's
    real devices start one)."""
    arguments = list(args)
    if "--devices" in arguments:
        at = arguments.index("--devices")
        assert int(arguments[at + 1]) == len(jax.devices()), f"{script} asks for {arguments[at + 1]} devices"
        arguments[at + 1] = "0"
    module = load_example(pathlib.Path(script).stem, prefix="example_here")
    stdout, stderr, environment = io.StringIO(), io.StringIO(), dict(os.environ)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = module.main(arguments)
    finally:
        os.environ.clear()
        os.environ.update(environment)
        sys.modules.pop(module.__name__, None)
    returncode = code if isinstance(code, int) else 0  # lm.py's main returns its loss; its script exits 0
    return ExampleRun(returncode, stdout.getvalue(), stderr.getvalue())


def run_guide(page: pathlib.Path, namespace: dict | None = None, *, first: int | None = None, where: str = "") -> dict:
    """Runs a guide's ```python blocks as written (its ``first`` ones, or those containing ``where``) in one
    namespace, and returns it. Each block is compiled under a name of its own, registered with ``linecache``
    and padded to the page's line numbers: a library that reads its caller's source (grain names a ``map``
    by ``inspect.getsourcelines``) reads the block, not the Markdown around it (Python 3.12's tokenizer
    stops at a table's backquote), and a traceback points at the page's line."""
    namespace = {} if namespace is None else namespace
    text = page.read_text()
    blocks = [m for m in re.finditer(r"```python\n(.*?)```", text, re.S) if where in m.group(1)][:first]
    assert blocks, f"{page} has no python block" + (f" containing {where!r}" if where else "")
    for match in blocks:
        start = text.count("\n", 0, match.start(1))
        name = f"{page}, the python block at line {start + 1}"
        source = "\n" * start + match.group(1)
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)
        exec(compile(source, name, "exec"), namespace)
    return namespace


def interrupt_with_backup(trainer, data, backup, at_batch: int = 2) -> dict:
    """``trainer.fit(data)`` for an epoch with a ``BackupAndRestore`` every step, stopped by an error after
    batch ``at_batch``; returns the backup's manifest (a resumed fit reads the backup)."""
    import trainkit as tk  # here: the conftest sets JAX's and trainkit's environment before trainkit is imported

    class Stop(tk.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == at_batch:
                raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        trainer.fit(data, epochs=1, verbose=0, callbacks=[tk.callbacks.BackupAndRestore(backup, save_freq=1), Stop()])
    with tk.checkpoint.Checkpointer(backup, read_only=True) as checkpoints:
        return checkpoints.manifest()


def tree_allclose(a, b, rtol=1e-5, atol=1e-6):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.fixture
def tmpfs(tmp_path):
    """A 4 MiB file system of its own (to fill, or to remount read-only); skips where mounting
    is not allowed."""
    import subprocess

    mount = tmp_path / "fs"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def saved_steps(directory):
    """The checkpoint steps in ``directory``, read by a checkpointer that is closed again (an
    open one leaves orbax's threads and the directory lock to the garbage collector)."""
    from trainkit.checkpoint import Checkpointer

    with Checkpointer(directory, read_only=True) as checkpoints:
        return checkpoints.steps()


@pytest.fixture(autouse=True)
def shared_compilation_cache(request, monkeypatch):
    """Every test compiles through the process's shared cache, except those of
    ``OWN_COMPILATION_CACHE``, which see JAX without one (as they set it up themselves); no
    test reads a strategy that "auto" remembered in another (trainkit's cache is off: it
    remembers nothing, as without a cache)."""
    from trainkit.distributed import compile_cache

    if request.module.__name__.rsplit(".", 1)[-1] not in OWN_COMPILATION_CACHE:
        monkeypatch.setattr(compile_cache, "active_directory", lambda: None)
        yield
        return
    jax.config.update("jax_compilation_cache_dir", None)
    jax_compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", COMPILATION_CACHE)
        jax_compilation_cache.reset_cache()


def pytest_unconfigure(config):
    if COMPILATION_CACHE:
        shutil.rmtree(COMPILATION_CACHE, ignore_errors=True)


#: The test files by their serial seconds in a measured run (2026-12-06, on 2 busy cores: 242, 217, 146,
#: 127, 109, 82, 76, 72, 69, 61, 56, 55, 55, 54, 52, 48, 47, 45, 44, 41, 38 s), run first; the others
#: follow in their own order. `make test` runs `--dist loadfile --no-loadscope-reorder`: each worker takes
#: the next file in this order, so the run does not end with one worker on a long file while the other
#: idles (xdist's own order, by the number of tests, ran test_faults last: about 50 s of one idle core).
HEAVIEST_FIRST = (
    "test_examples",
    "test_multihost",
    "test_pipeline_axis",
    "test_docs",
    "test_custom_training",
    "test_faults",
    "test_recipes",
    "test_context_axis",
    "test_tuning",
    "test_ports",
    "test_keras_fit_semantics",
    "test_finetuning",
    "test_save_pretrained",
    "test_keras_outputs",
    "test_monitoring",
    "test_steps_per_execution",
    "test_compile",
    "test_offload",
    "test_plan",
    "test_sharded",
    "test_compute_loss_contract",
)


def pytest_collection_modifyitems(items):
    """The heaviest files first (``HEAVIEST_FIRST``), each file's tests in their order."""
    rank = {name: index for index, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order
