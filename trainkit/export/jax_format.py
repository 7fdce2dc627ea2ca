"""The ``"jax"`` format: the bytes of ``jax.export.export(...).serialize()``, the variables
inside as constants, so that a process with neither trainkit nor the model's code runs it:
``jax.export.deserialize(bytearray(open(path, "rb").read())).call(x)``.

Beside it, ``<path>.json`` (the sidecar) holds the payload's length and SHA-256 digest, its
calling convention version, platforms and input and output names: :func:`load` checks the file
against it before anything runs, refuses a file that does not match (a flipped byte, a truncated
copy) naming what differs, and loads a file without a sidecar as it is. Files of trainkit
before the sidecar (a 4,096-byte header starting with ``MAGIC`` before the payload) still load.

>>> import numpy as np, os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "double.jax")
>>> from trainkit.export.signature import symbolic_inputs
>>> save(path, lambda w, x: w * x, 2.0, symbolic_inputs(((3,), "float32")))["calling_convention_version"] >= 9
True
>>> load(path)(np.ones((4, 3), np.float32)).shape
(4, 3)
>>> header(path)["payload_bytes"] == os.path.getsize(path)
True
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Sequence

import jax
import numpy as np

from trainkit.core.local_path import LocalPath, require_local
from trainkit.core.tree import PyTree, TreeFunction
from trainkit.export.signature import leaf_names, output_names

#: The first bytes of a trainkit ``"jax"`` export written with a header (before the sidecar), and
#: the header's fixed size.
MAGIC = b"TRAINKIT-JAX-EXPORT\n"
HEADER_BYTES = 4096
#: the sidecar's suffix: ``model.jax.json`` describes ``model.jax``
SIDECAR = ".json"


def save(
    path: LocalPath, function: TreeFunction, variables: PyTree, inputs: PyTree, platforms: Sequence[str] | None = None
) -> dict[str, object]:
    """Exports ``function(variables, x)`` for the symbolic ``inputs``, the variables inside as
    constants (for ``platforms``, default the current backend), into ``path``, and its
    description into ``path + ".json"``; returns what was written (bytes, calling convention,
    platforms)."""
    exported = jax.export.export(jax.jit(functools.partial(function, variables)), platforms=platforms)(inputs)
    data = bytes(exported.serialize())
    described: dict[str, object] = {
        "format": 2,
        "payload_bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "calling_convention_version": exported.calling_convention_version,
        "platforms": list(exported.platforms),
        "inputs": leaf_names(inputs, "input"),
        "outputs": output_names(function, variables, inputs),
    }
    with open(path, "wb") as file:
        file.write(data)
    with open(os.fspath(path) + SIDECAR, "w") as file:
        json.dump(described, file, indent=1)
    return {"bytes": len(data), **{k: described[k] for k in ("calling_convention_version", "platforms")}}


def _checked(described: object, where: str) -> dict[str, object]:
    if not (
        isinstance(described, dict)
        and isinstance(described.get("payload_bytes"), int)
        and isinstance(described.get("sha256"), str)
    ):
        raise ValueError(f"{where} is damaged (no payload length and digest); export the model again.")
    return described


def _headed(path: LocalPath) -> bool:
    with open(path, "rb") as file:
        return file.read(len(MAGIC)) == MAGIC


def header(path: LocalPath) -> dict[str, object]:
    """What the sidecar (or, for an older file, the header) says of a ``"jax"`` export; ``{}``
    for a plain serialization without either."""
    sidecar = os.fspath(path) + SIDECAR
    if os.path.isfile(sidecar) and not _headed(path):
        where = f"{sidecar}, the description of {path},"
        try:
            with open(sidecar) as file:
                described = json.load(file)
        except (OSError, ValueError) as error:
            raise ValueError(f"{where} is damaged ({error}); export the model again.") from error
        return _checked(described, where)
    if not _headed(path):
        return {}
    with open(path, "rb") as file:
        head = file.read(HEADER_BYTES)
    try:
        described = json.loads(head[len(MAGIC) :].decode())
    except ValueError as error:
        raise ValueError(f"{path}: its header is damaged ({error}); export the model again.") from error
    return _checked(described, f"{path}: its header")


def payload(path: LocalPath) -> bytearray:
    """The ``jax.export`` bytes of a ``"jax"`` export, checked against the length and digest its
    sidecar (or older header) records; a plain serialization is returned as it is."""
    described = header(path)
    with open(path, "rb") as file:
        data = bytearray(file.read())
    if not described:
        return data
    body = data[HEADER_BYTES:] if data.startswith(MAGIC) else data
    digest = hashlib.sha256(body).hexdigest()
    if len(body) != described.get("payload_bytes") or digest != described.get("sha256"):
        raise ValueError(
            f"{path} is damaged: its model is {len(body)} bytes with SHA-256 {digest[:16]}..., but it was written "
            f"as {described.get('payload_bytes')} bytes with {str(described.get('sha256'))[:16]}...; copy it again "
            "(with its .json beside it) from where it was exported, or export the model again."
        )
    return body


class LoadedModel:
    """A ``"jax"`` export read back: call it with inputs of the structure it was exported with
    (any batch size, 0 rows too: the outputs then have 0 rows); ``exported`` is the
    ``jax.export.Exported``."""

    def __init__(self, exported: jax.export.Exported, path: str):
        self.exported, self.path = exported, path

    def __call__(self, x: PyTree) -> PyTree:
        leaves = jax.tree.leaves(x)
        if leaves and all(np.shape(leaf)[:1] == (0,) for leaf in leaves):  # 0 rows: jax.export's sizes start at 1
            one = jax.tree.map(lambda leaf: np.zeros((1, *np.shape(leaf)[1:]), np.asarray(leaf).dtype), x)
            return jax.tree.map(lambda out: out[:0], self.exported.call(one))  # rows are independent
        return self.exported.call(x)

    @property
    def input_shapes(self) -> PyTree:
        """The exported inputs (``jax.ShapeDtypeStruct``s, the batch axis symbolic)."""
        return jax.tree.unflatten(self.exported.in_tree, self.exported.in_avals)[0][0]

    def __repr__(self) -> str:
        return f"LoadedModel({self.path!r}, inputs={self.input_shapes}, platforms={self.exported.platforms})"


def load(path: LocalPath) -> LoadedModel:
    """The ``"jax"`` export at ``path`` as a callable, refused with the reason when this JAX
    cannot run its calling convention or the file is no ``jax.export`` serialization."""
    path = require_local(path, "tk.export.load's path")
    data = payload(path)
    try:
        exported = jax.export.deserialize(data)
    except Exception as error:  # noqa: BLE001 - flatbuffers' own errors say nothing of the file
        raise ValueError(
            f"{path} is not a model exported with format='jax' (jax.export could not read its "
            f"{len(data)} bytes: {type(error).__name__}: {error}). Pass the file trainer.export(path) wrote."
        ) from error
    low, high = (
        jax.export.minimum_supported_calling_convention_version,
        jax.export.maximum_supported_calling_convention_version,
    )
    version = exported.calling_convention_version
    if not low <= version <= high:
        raise ValueError(
            f"{path} was exported with calling convention version {version}, but JAX {jax.__version__} runs "
            f"versions {low} to {high}: load it with a JAX that supports version {version}, or export it again."
        )
    platform = jax.default_backend()
    if platform not in exported.platforms and not (platform == "gpu" and {"cuda", "rocm"} & set(exported.platforms)):
        raise ValueError(
            f"{path} was exported for {list(exported.platforms)}, and this process runs on {platform}: export "
            f"it again with trainer.export(path, platforms=[..., {platform!r}])."
        )
    return LoadedModel(exported, str(path))
