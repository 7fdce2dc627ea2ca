"""Where published weights are read from: a safetensors file or a folder of shards, an orbax
checkpoint of a params tree, a ``.npz`` or a nested dict of arrays; each as named entries
(``"Dense_0/kernel"``, or the file's own names) whose parts are read on request, so that a
device's shard is read without the whole array (safetensors: memory-mapped slices).

>>> import numpy as np
>>> source = open_source({"Dense_0": {"kernel": np.arange(6.0).reshape(3, 2)}})
>>> source.entries["Dense_0/kernel"], source.read("Dense_0/kernel", (slice(1, 2), slice(None))).tolist()
(Entry(shape=(3, 2), dtype=dtype('float64')), [[2.0, 3.0]])
"""

from __future__ import annotations

import glob
import json
import os
import struct
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import jax
import ml_dtypes
import numpy as np

from trainkit.core.tree import PyTree, leaf_name

#: safetensors' dtype names (the format's header) as NumPy dtypes (bf16 and fp8 from ml_dtypes)
SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class Entry(NamedTuple):
    """One named array of a source: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: np.dtype


class WeightSource(Protocol):
    """Named arrays read in parts: ``entries`` by name; ``read(name, index)`` the part at
    ``index`` (a tuple of slices, as ``jax.make_array_from_callback`` asks for a device's shard)."""

    entries: dict[str, Entry]
    description: str

    def read(self, name: str, index: tuple) -> np.ndarray: ...


class ArraySource:
    """Arrays already in memory (a nested dict, a ``.npz``), named by their paths."""

    def __init__(self, arrays: Mapping[str, Any], description: str):
        self.arrays, self.description = dict(arrays), description
        self.entries = {name: Entry(tuple(np.shape(a)), np.dtype(a.dtype)) for name, a in self.arrays.items()}

    def read(self, name: str, index: tuple) -> np.ndarray:
        return np.asarray(self.arrays[name][index])


class SafetensorsSource:
    """One safetensors file or a folder of shards (``*.safetensors``), memory-mapped: a read
    touches only the pages of the part it asks for. The header is parsed here (8 bytes of
    length, then JSON), as the format specifies, so that bf16 and fp8 entries read as
    ``ml_dtypes`` arrays (the ``safetensors`` package's NumPy reader refuses them)."""

    def __init__(self, paths: list[str], description: str):
        self.description = description
        self._where: dict[str, tuple[str, int, Entry]] = {}
        for path in paths:
            for name, (offset, entry) in _safetensors_header(path).items():
                if name in self._where:
                    raise ValueError(f"{name!r} is in two shards: {self._where[name][0]} and {path}.")
                self._where[name] = (path, offset, entry)
        self.entries = {name: entry for name, (_, _, entry) in self._where.items()}
        self._maps: dict[str, np.ndarray] = {}

    def read(self, name: str, index: tuple) -> np.ndarray:
        path, offset, entry = self._where[name]
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        size = int(np.prod(entry.shape, dtype=np.int64)) * entry.dtype.itemsize
        array = self._maps[path][offset : offset + size].view(entry.dtype).reshape(entry.shape)
        return np.array(array[index])  # a copy: only the part read leaves the file


def _safetensors_header(path: str) -> dict[str, tuple[int, Entry]]:
    """``{name: (absolute byte offset, entry)}`` from a safetensors file's header."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    found = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: {name!r} has dtype {info['dtype']}, which trainkit does not read.")
        begin, _ = info["data_offsets"]
        found[name] = (8 + length + begin, Entry(tuple(info["shape"]), np.dtype(SAFETENSORS_DTYPES[info["dtype"]])))
    return found


class OrbaxSource:
    """An orbax checkpoint of a params tree (a step folder, or a folder whose item is one),
    named by its tree's paths. Parts are read through a restore of the entries asked for, with
    the shardings asked for (:meth:`place`), so each device's shard is read by its process."""

    def __init__(self, path: str, description: str):
        import orbax.checkpoint as ocp

        self.path, self.description = path, description
        self._metadata = _plain(ocp.StandardCheckpointer().metadata(path).item_metadata.tree)
        self.entries = {
            leaf_name(key): Entry(tuple(leaf.shape), np.dtype(leaf.dtype))
            for key, leaf in jax.tree_util.tree_leaves_with_path(self._metadata)
        }

    def read(self, name: str, index: tuple) -> np.ndarray:
        return np.asarray(self.place({name: None})[name])[index]

    def place(self, shardings: Mapping[str, jax.sharding.Sharding | None]) -> dict[str, jax.Array]:
        """The entries named, restored in these shardings (``None``: the first device); the
        others are not read."""
        import orbax.checkpoint as ocp

        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

        def target(key: Any, leaf: Any) -> Any:
            name = leaf_name(key)
            if name not in shardings:
                return ocp.PLACEHOLDER
            return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype, sharding=shardings[name] or default)

        abstract = jax.tree_util.tree_map_with_path(target, self._metadata)
        restored = ocp.StandardCheckpointer().restore(self.path, abstract)
        return {
            leaf_name(key): leaf
            for key, leaf in jax.tree_util.tree_leaves_with_path(restored)
            if leaf_name(key) in shardings
        }


def _plain(tree: Any) -> Any:
    """Orbax's tree metadata as nested dicts of leaves with ``shape`` and ``dtype``."""
    if isinstance(tree, Mapping):
        return {key: _plain(value) for key, value in tree.items()}
    return tree


def flat_arrays(tree: PyTree) -> dict[str, Any]:
    """``{"a/b": array}`` for a nested dict (or any pytree) of arrays; a flat dict's keys kept."""
    return {leaf_name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def open_source(source: Any) -> WeightSource:
    """The source of ``source``: a path (``.safetensors`` file, folder of shards, orbax
    checkpoint folder, ``.npz``) or a dict of arrays (nested, or flat with ``/`` names)."""
    if isinstance(source, Mapping):
        return ArraySource(flat_arrays(source), "a dict of arrays")
    path = os.fspath(source)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"No weights at {path!r}: pass a .safetensors file, a folder of them, an orbax "
            "checkpoint, a .npz or a dict of arrays."
        )
    if os.path.isfile(path):
        if path.endswith(".npz"):
            with np.load(path) as archive:
                return ArraySource({name: archive[name] for name in archive.files}, path)
        return SafetensorsSource([path], path)
    shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if shards:
        return SafetensorsSource(shards, f"{path} ({len(shards)} safetensors shards)")
    return OrbaxSource(path, path)
