"""Multi-process training on JAX's own multi-controller runtime (``jax.distributed``).

Every process runs the same script; ``initialize`` connects them (explicit arguments, or the
job the engine that started the process describes: trainkit's launcher, JAX's or torchrun's
variables, SLURM, Open MPI, Kubernetes, Ray Train, TPU pods; see :mod:`.engines`). The Trainer
calls it itself when the process is one of several. ``python -m trainkit.launch`` starts local
processes for a try-out.

>>> is_main_process(), process_count() >= 1
(True, True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from trainkit.distributed import engines, environment, joining, ray_train, tpu_slice
from trainkit.internals import runtime

T = TypeVar("T")

#: Seconds without a heartbeat after which JAX's coordination service declares a process dead
#: and stops the others (JAX's own default is 100).
HEARTBEAT_TIMEOUT = 20


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return int(jax.process_count())


def is_main_process() -> bool:
    """True on process 0: the one that prints, logs and writes the small files."""
    return jax.process_index() == 0


def is_initialized() -> bool:
    return runtime.distributed_initialized()


#: seconds this process spent starting (``jax.distributed``, the backend) not yet in a goodput ledger
_STARTUP: dict[str, float] = {}


def take_startup_seconds() -> dict[str, float]:
    """The start-up seconds of this process not yet counted, once (the first ``fit``'s ledger
    takes them): ``jax.distributed``'s connection, and the backend's start, which this starts
    (timed) when nothing has yet."""
    if not runtime.backends_started():
        start = time.perf_counter()
        jax.devices()
        _STARTUP["backend"] = _STARTUP.get("backend", 0.0) + time.perf_counter() - start
    taken = dict(_STARTUP)
    _STARTUP.clear()
    return taken


def requested_by_environment() -> bool:
    """Whether this process is one of several of a job (see :func:`job`)."""
    found = job()
    return found is not None and found.several


def job() -> engines.Job | None:
    """The multi-process job this process belongs to, as the engine that started it describes it
    (:func:`trainkit.distributed.engines.detect_job`, a Ray Train worker group, a TPU pod);
    ``None`` for a process on its own. Raises :class:`~trainkit.distributed.engines.JobError`
    when the environment says this process is one of several tasks but not how to join them.

    >>> job() is None
    True
    """
    found = engines.detect_job()
    if found is not None or engines.opted_out():
        return found
    return ray_train.worker_job() or _tpu_pod_job()


@functools.cache
def _tpu_pod_job() -> engines.Job | None:
    """A host of a multi-host TPU slice, as JAX's own TPU detection (GCE's metadata, GKE's
    ``TPU_WORKER_HOSTNAMES``) sees it; asked only on a TPU VM, once per process (the slice does
    not change; every Trainer asks), and only where the environment says the slice has several
    hosts or says nothing (:mod:`.tpu_slice`): a single-host machine never asks a metadata server.
    Where the environment says nothing and the metadata server cannot be reached, this host trains
    alone (one line says so); where it says several hosts, a :class:`~.engines.JobError` says
    what to set."""
    if not runtime.on_cloud_tpu_vm():
        return None
    try:
        described = tpu_slice.environment_job()
    except tpu_slice.SliceError as error:
        raise engines.JobError(
            f"This TPU host's environment describes its slice, but not as a job can be joined from: {error}. "
            f"Set the variables to what the slice is ({tpu_slice.described()}), or TRAINKIT_DISTRIBUTED=off to "
            "train on each host alone."
        ) from None
    if described is not None:  # everything said: JAX's detection (and its metadata queries) never runs
        coordinator, count, index = described
        if count == 1:
            return None
        try:
            joining.resolved(coordinator)
        except RuntimeError:
            raise engines.JobError(
                f"The coordinator of this TPU slice, {coordinator} (the first worker of "
                f"{tpu_slice.described()}), does not resolve: no host could reach it. Name the slice's hosts as "
                "the other hosts reach them (each host's DNS name or IP address, in worker order)."
            ) from None
        return engines.Job("tpu", count, index, coordinator)
    hosts = tpu_slice.hosts()
    if hosts == 1:
        return None
    if hosts is None and not tpu_slice.metadata_reachable():
        print(
            "trainkit: a TPU machine without GCE's metadata server, and nothing in the environment says its "
            "slice has several hosts (TPU_WORKER_HOSTNAMES, TPU_ACCELERATOR_TYPE): this host trains alone.",
            file=sys.stderr,
            flush=True,
        )
        return None
    try:
        found = _jax_tpu_job()
    except Exception as error:  # noqa: BLE001 - requests' ConnectionError, a metadata key missing, ...
        raise _unjoinable(hosts, f"{type(error).__name__}: {str(error)[:200]}") from error
    if found is None and hosts is not None:
        raise _unjoinable(hosts, "neither GCE's metadata nor GKE's variables describe the slice")
    return found


def _unjoinable(hosts: int | None, why: str) -> engines.JobError:
    return engines.JobError(
        f"The environment says this host is one of {hosts or 'several'} hosts of a TPU slice "
        f"({tpu_slice.described()}), but JAX's TPU detection could not find the others ({why}). "
        f"To train together, {tpu_slice.WHAT_TO_SET}."
    )


def _jax_tpu_job() -> engines.Job | None:
    """The slice's job as JAX's cloud-TPU cluster detection reads it (``None``: one host)."""
    found = runtime.tpu_slice_processes()
    if found is None or found[1] < 2:
        return None
    detection, count = found
    return engines.Job("tpu", count, None, None, detection=detection)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    heartbeat_timeout_seconds: int | None = None,
    initialization_timeout: float | None = None,
) -> None:
    """Connects this process to the others; call it first thing in the script (the Trainer calls
    it itself when the process is one of several: :func:`initialize_from_environment`).
    ``initialization_timeout``: seconds to wait for every process to connect (default
    ``TRAINKIT_JOIN_TIMEOUT``, else 120; :mod:`trainkit.distributed.joining`); past them the
    process ends with a line naming the coordinator, its index, the count and what did not answer.

    Arguments left out come from the engine that started the process (:func:`job`: trainkit's
    launcher, JAX's or torchrun's variables, SLURM, Open MPI, Kubernetes, Ray Train, a TPU pod),
    else from JAX's cluster detection. When the coordinator, the count and this process's index
    are known, JAX's detection does not run. Each process takes its share of the node's GPUs
    (:func:`~trainkit.distributed.engines.local_devices`); on CPU the collectives run over gloo.
    Process 0 prints the layout in force. A second call is a no-op.
    """
    if is_initialized():
        return
    try:
        found = job()
    except engines.JobError:
        if None in (coordinator_address, num_processes, process_id):
            raise
        found = None  # the arguments say how to join
    found = found or engines.Job("jax", None, None, None, detection=None)  # else JAX's own detection
    given = dataclasses.replace(
        found,
        coordinator_address=coordinator_address or found.coordinator_address,
        num_processes=found.num_processes if num_processes is None else num_processes,
        process_id=found.process_id if process_id is None else process_id,
    )
    _join(given, local_device_ids, heartbeat_timeout_seconds, initialization_timeout)


def _join(
    found: engines.Job,
    local_device_ids: Sequence[int] | None = None,
    heartbeat_timeout_seconds: int | None = None,
    initialization_timeout: float | None = None,
) -> None:
    """``jax.distributed.initialize`` for ``found`` (its values already merged with the arguments),
    bounded by :func:`trainkit.distributed.joining.bounded` where the coordinator is known (its
    address resolved first; on process 0, its port checked free)."""
    if runtime.backends_started():
        raise RuntimeError(
            "tk.distributed.initialize() must run before anything touches JAX's devices, but the "
            "backend has already started (something called jax.devices(), created an array or "
            "ran a jitted function). Call tk.distributed.initialize() (or create the Trainer) at "
            "the top of the script, before any other JAX call."
        )
    coordinator_address, num_processes, process_id = found.coordinator_address, found.num_processes, found.process_id
    if found.engine == "ray" and coordinator_address is None:
        coordinator_address = ray_train.coordinator_address()
    known = None not in (coordinator_address, num_processes, process_id)
    if local_device_ids is None and known:
        local_device_ids = engines.local_devices(found)
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # noqa: BLE001 - a JAX without the option: its default
        pass
    if heartbeat_timeout_seconds is None:  # TRAINKIT_HEARTBEAT_TIMEOUT, else HEARTBEAT_TIMEOUT
        heartbeat_timeout_seconds = math.ceil(environment.seconds("TRAINKIT_HEARTBEAT_TIMEOUT", HEARTBEAT_TIMEOUT))
    if found.engine == "kubernetes" and not known:
        engines.require_service_account()  # what JAX's detection reads the pods with
    bound = joining.join_timeout(initialization_timeout)
    guard: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if known:
        assert coordinator_address is not None and num_processes is not None and process_id is not None
        joining.resolved(coordinator_address)
        if process_id == 0:
            joining.check_port_free(coordinator_address)
        guard = joining.bounded(coordinator_address, process_id, num_processes, found.engine, bound)
    start = time.perf_counter()
    with guard:  # JAX's own timeout later than trainkit's bound: trainkit's line, not a C++ abort
        jax.distributed.initialize(
            coordinator_address,
            num_processes,
            process_id,
            local_device_ids=local_device_ids,
            cluster_detection_method="deactivate" if known else found.detection,
            heartbeat_timeout_seconds=heartbeat_timeout_seconds,
            initialization_timeout=math.ceil(bound) + 30,
        )
    _STARTUP["jax.distributed"] = time.perf_counter() - start
    _exit_fast_on_uncaught_errors()
    _announce(found.engine)


def _announce(engine: str) -> None:
    """On process 0: the layout in force, the first line of a multi-process run."""
    start = time.perf_counter()
    devices = jax.local_devices()
    _STARTUP["backend"] = _STARTUP.get("backend", 0.0) + time.perf_counter() - start
    if jax.process_index() == 0:
        kinds = sorted({device.platform for device in devices})
        print(
            f"trainkit: {jax.process_count()} processes ({engine}) x {len(devices)} local "
            f"{'/'.join(kinds)} devices each = {jax.device_count()} devices",
            flush=True,
        )


def _exit_fast_on_uncaught_errors() -> None:
    """An uncaught exception in one process of a multi-process job prints its traceback and
    ends the process at once (exit status 1). Left to the normal interpreter exit, JAX's
    shutdown barrier would wait minutes for peers stuck in a collective with the failed
    process, and they would be the ones reported as failing (SIGABRT). The launcher, or the
    coordination service's heartbeat, then ends the others within seconds."""
    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        previous(kind, value, traceback)
        if issubclass(kind, SystemExit):  # tk.Preempted and sys.exit: a normal exit
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    sys.excepthook = excepthook


def leave_now(error: SystemExit, where: str) -> None:
    """``sys.exit(...)`` raised out of ``where`` (``fit``: a callback's) on one process of a
    multi-process job ends that process at once with the status it asked for. Left to the
    normal interpreter exit, JAX's shutdown barrier waits for peers that wait in a collective for
    this process: the job hung for minutes and the status was lost. The launcher (or the
    coordination service's heartbeat) then ends the others, naming this one and its status. On
    one process it returns: the ``SystemExit`` goes on as Python raises it."""
    if process_count() <= 1:
        return
    code = error.code
    status = 0 if code is None else code if isinstance(code, int) else 1
    if not isinstance(code, int) and code is not None:
        print(code, file=sys.stderr)  # as Python prints a non-integer exit "status"
    print(
        f"trainkit: process {process_index()} of {process_count()} leaves the job with exit status {status}: "
        f"SystemExit raised in {where} (sys.exit); the other processes are ended with it.",
        file=sys.stderr,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def initialize_from_environment() -> None:
    """``initialize()`` when this process is one of several of a job (:func:`job`) and it has
    not run; a :class:`~trainkit.distributed.engines.JobError` naming the fix when it is one of
    several tasks that cannot join (never N silent copies). The job is read once."""
    if is_initialized():
        return
    found = job()
    if found is not None and found.several:
        _join(found)


#: Seconds every process waits for the others before gathering a sharded array: a gather
#: called on one process only (``if process_index() == 0: trainer.params``) fails with a clear
#: error instead of hanging for minutes. ``TRAINKIT_GATHER_TIMEOUT`` overrides it.
GATHER_TIMEOUT = 60
_gathers = 0


def _everyone_gathers() -> None:
    """A coordination-service barrier before a cross-process gather, with a timeout."""
    global _gathers
    _gathers += 1
    client = runtime.distributed_client()
    if client is None:
        return
    timeout = environment.seconds("TRAINKIT_GATHER_TIMEOUT", GATHER_TIMEOUT)
    try:
        client.wait_at_barrier(f"trainkit-gather-{_gathers}", int(timeout * 1000))
    except Exception as error:  # noqa: BLE001 - DEADLINE_EXCEEDED and friends
        raise RuntimeError(
            f"Process {jax.process_index()} waited {timeout:g} s for the other processes to read the same sharded "
            "arrays (trainer.params, get_weights(), ...): they never came. Reading sharded values gathers them "
            "from every process, so call it on every process (then use the result on process 0 only), not "
            f"inside `if jax.process_index() == 0:`. ({type(error).__name__}: {str(error)[:200]})"
        ) from None


def fetch(tree: Any) -> Any:
    """Host NumPy copies of a tree of arrays, also when they span processes: a replicated array
    is read from a local shard; a sharded one is gathered from every process (after a barrier
    with a timeout, so a call on one process only fails clearly instead of hanging)."""
    if any(
        isinstance(leaf, jax.Array) and not leaf.is_fully_addressable and not leaf.is_fully_replicated
        for leaf in jax.tree.leaves(tree)
    ):
        _everyone_gathers()

    def host(leaf):
        if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
            return leaf
        if leaf.is_fully_replicated:
            return np.asarray(leaf.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))

    leaves, treedef = jax.tree.flatten(jax.tree.map(host, tree))
    for leaf in leaves:  # every copy under way before the first wait (cheaper than jax.device_get)
        if isinstance(leaf, jax.Array):
            leaf.copy_to_host_async()
    return jax.tree.unflatten(treedef, [np.asarray(leaf) if isinstance(leaf, jax.Array) else leaf for leaf in leaves])


def global_replicas(tree: T) -> T:
    """With several processes, every array held on this process's devices only and replicated
    there (``jax.pmap``'s replicated outputs: ``DataParallel``'s state) as one array replicated
    over every device of every process, which orbax can write; the rest as it is. On one
    process the tree itself.

    >>> import jax.numpy as jnp
    >>> float(global_replicas({"w": jnp.ones(2)})["w"].sum())
    2.0
    """
    if jax.process_count() == 1:
        return tree
    everywhere = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("all",)), P())

    def global_replica(leaf: object) -> object:
        if isinstance(leaf, jax.Array) and leaf.is_fully_addressable and leaf.is_fully_replicated:
            return jax.make_array_from_process_local_data(everywhere, np.asarray(leaf.addressable_data(0)))
        return leaf

    replicas: T = jax.tree.map(global_replica, tree)
    return replicas


def check_same_configuration(config: Mapping[str, object]) -> None:
    """Raises on every process if ``config`` (JSON-able) differs between processes, naming the
    fields and each process's value. Free on one process."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digests = np.array([_digest(config[k]) for k in sorted(config)], dtype=np.int64)
    everyone = np.asarray(multihost_utils.process_allgather(digests))
    differing = [k for i, k in enumerate(sorted(config)) if len(set(everyone[:, i].tolist())) > 1]
    if differing:
        values = gather_json({k: config[k] for k in differing})
        per_process = [json.dumps(value, default=str) for value in values]
        raise ValueError(
            f"The processes were started with different settings for {', '.join(differing)}: "
            + "; ".join(f"process {i}: {v}" for i, v in enumerate(per_process))
            + ". Every process must run the same script with the same arguments."
        )


def _digest(value: object) -> int:
    text = json.dumps(value, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:7], "little")


def broadcast_int(value: int) -> int:
    """Process 0's ``value`` on every process (a collective); ``value`` itself on one.

    >>> broadcast_int(7)
    7
    """
    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def gather_json(value: T) -> list[T]:
    """``value`` (JSON-able: lists, dicts of str keys, numbers, strings; no tuples) of every process,
    in process order; ``[value]`` on one process. Call it on every process (it is a collective).

    >>> gather_json({"next_index": 4})
    [{'next_index': 4}]
    """
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    text = np.frombuffer(json.dumps(value, default=str).encode(), np.uint8)
    longest = int(np.max(np.asarray(multihost_utils.process_allgather(np.array([len(text)], np.int64)))))
    padded = np.zeros(longest, np.uint8)
    padded[: len(text)] = text
    rows = np.asarray(multihost_utils.process_allgather(padded))
    values: list[T] = [json.loads(bytes(row).rstrip(b"\0").decode()) for row in rows]
    return values
