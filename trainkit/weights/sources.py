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
import math
import os
import struct
import sys
import zipfile
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import jax
import ml_dtypes
import numpy as np

from trainkit.core.local_path import LocalPath, require_local
from trainkit.core.tree import ArrayValue, Index, PyTree, leaf_name
from trainkit.weights.pretrained import INDEX, WEIGHTS

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

    def read(self, name: str, index: Index) -> np.ndarray: ...


class ArraySource:
    """Arrays already in memory (a nested dict, a ``.npz``), named by their paths."""

    def __init__(self, arrays: Mapping[str, ArrayValue], description: str):
        self.arrays, self.description = dict(arrays), description
        self.entries = {name: Entry(tuple(np.shape(a)), np.dtype(a.dtype)) for name, a in self.arrays.items()}

    def read(self, name: str, index: Index) -> np.ndarray:
        return np.asarray(self.arrays[name])[index]


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

    def shard_of(self, name: str) -> str | None:
        """The file that holds the entry ``name`` (``None``: no file does)."""
        where = self._where.get(name)
        return None if where is None else where[0]

    def read(self, name: str, index: Index) -> np.ndarray:
        path, offset, entry = self._where[name]
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        size = int(np.prod(entry.shape, dtype=np.int64)) * entry.dtype.itemsize
        array = self._maps[path][offset : offset + size].view(entry.dtype).reshape(entry.shape)
        return np.array(array[index])  # a copy: only the part read leaves the file


#: the longest header safetensors' own reader accepts (bytes)
MAX_HEADER = 100_000_000


class WeightFileError(ValueError):
    """A weight file that cannot be trusted: names the file, the entry and what to do."""


def _refuse(path: str, what: str) -> WeightFileError:
    return WeightFileError(
        f"{path} is not a valid safetensors file: {what}. Nothing was loaded; write the file again "
        "(safetensors' save_file, or trainer.save_weights) or download it again."
    )


def _read_header(path: str) -> tuple[dict[str, dict[str, Any]], int, int]:
    """The header's JSON object, where the data after it starts and its byte count."""
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise _refuse(path, f"it is {size} bytes long, shorter than the 8 bytes that give the header's length")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_HEADER, size - 8):
            raise _refuse(path, f"its header would be {length} bytes long, in a file of {size} bytes")
        raw = file.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise _refuse(path, f"its header is not JSON ({error})") from None
    except RecursionError:  # a header nested deeper than Python's parser goes
        raise _refuse(path, "its header's JSON is nested too deeply to be a header of tensors") from None
    if not isinstance(header, dict):
        raise _refuse(path, f"its header is a JSON {type(header).__name__}, not an object of tensors")
    return header, 8 + length, size - 8 - length


def _checked_entry(path: str, name: str, info: object, data_size: int) -> tuple[int, int, Entry]:
    """An entry's byte range in the data and its shape and dtype, each checked as safetensors'
    own reader checks them."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise _refuse(path, f"entry {name!r} lacks its dtype, shape or data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        raise WeightFileError(f"{path}: {name!r} has dtype {str(dtype)[:40]}, which trainkit does not read.")
    lists = isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2
    if not lists or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in [*shape, *offsets]):
        raise _refuse(
            path, f"entry {name!r} has shape {str(shape)[:60]} and data_offsets {str(offsets)[:60]}, not "
            "non-negative integers",
        )  # fmt: skip
    begin, end = offsets
    entry_dtype = np.dtype(SAFETENSORS_DTYPES[dtype])
    needed = math.prod(shape) * entry_dtype.itemsize  # Python's integers: a shape past 2**63 cannot overflow
    if not begin <= end <= data_size or end - begin != needed:
        raise _refuse(
            path,
            f"entry {name!r} spans bytes {begin} to {end} of {data_size}, where its shape {tuple(shape)} of {dtype} "
            f"needs {needed} bytes",
        )
    return begin, end, Entry(tuple(shape), entry_dtype)


def _safetensors_header(path: str) -> dict[str, tuple[int, Entry]]:
    """``{name: (absolute byte offset, entry)}`` from a safetensors file's header, checked as
    safetensors' own reader checks it: every range inside the file and as long as its shape
    needs, the ranges back to back in order, covering the data exactly (no overlap, no gap)."""
    header, start, data_size = _read_header(path)
    spans = []
    for name, info in header.items():
        if name != "__metadata__":
            spans.append((*_checked_entry(path, name, info, data_size), name))
    position, previous = 0, None
    for begin, end, _, name in sorted(spans, key=lambda span: (span[0], span[1])):
        if begin != position:
            what = f"overlaps {previous!r}" if begin < position else f"leaves bytes {position} to {begin} unused"
            raise _refuse(path, f"entry {name!r} (bytes {begin} to {end}) {what}")
        position, previous = end, name
    if position != data_size:
        raise _refuse(path, f"its tensors end at byte {position} of its {data_size} bytes of data")
    return {name: (start + begin, entry) for begin, _, entry, name in spans}


class OrbaxSource:
    """An orbax checkpoint of a params tree (a step folder, or a folder whose item is one),
    named by its tree's paths. Parts are read through a restore of the entries asked for, with
    the shardings asked for (:meth:`place`), so each device's shard is read by its process."""

    def __init__(self, path: str, description: str, roots: Mapping[str, str] | None = None):
        """``roots``: read only the subtrees under these top-level keys, each entry named with the
        key replaced by its value (a trainkit checkpoint's ``{"params/": "", "model_state/": ""}``)."""
        import orbax.checkpoint as ocp

        self.path, self.description = path, description
        self._metadata = _plain(ocp.StandardCheckpointer().metadata(path).item_metadata.tree)
        roots = roots or {"": ""}
        self._names: dict[str, str] = {}  # the tree's leaf name -> the entry's name
        self.entries: dict[str, Entry] = {}
        for key, leaf in jax.tree_util.tree_leaves_with_path(self._metadata):
            name = leaf_name(key)
            root = next((r for r in roots if name.startswith(r)), None)
            if root is not None:
                entry = self._names[name] = roots[root] + name[len(root) :]
                self.entries[entry] = Entry(tuple(leaf.shape), np.dtype(leaf.dtype))

    def read(self, name: str, index: Index) -> np.ndarray:
        whole: np.ndarray = np.asarray(self.place({name: None})[name])
        return whole[index]

    def place(self, shardings: Mapping[str, jax.sharding.Sharding | None]) -> dict[str, jax.Array]:
        """The entries named, restored in these shardings (``None``: the first device); the
        others are not read (orbax's partial restore of the tree of those alone)."""
        import orbax.checkpoint as ocp

        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        item: dict[str, Any] = {}
        for key, leaf in jax.tree_util.tree_leaves_with_path(self._metadata):
            name = self._names.get(leaf_name(key))
            if name is None or name not in shardings:
                continue
            *parents, last = [str(part) for part in leaf_name(key).split("/")]
            node = item
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype, sharding=shardings[name] or default)
        restore_args = ocp.checkpoint_utils.construct_restore_args(item)
        try:
            args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
        except TypeError:  # orbax before partial_restore: an empty transform restores the target's keys alone
            args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, transforms={})
        restored = ocp.PyTreeCheckpointer().restore(self.path, args=args)
        return {self._names[leaf_name(key)]: leaf for key, leaf in jax.tree_util.tree_leaves_with_path(restored)}


def _plain(tree: PyTree) -> PyTree:
    """Orbax's tree metadata as nested dicts of leaves with ``shape`` and ``dtype``."""
    if isinstance(tree, Mapping):
        return {key: _plain(value) for key, value in tree.items()}
    return tree


def host_array(leaf: Any) -> Any:
    """A dict's value as an array NumPy reads: a PyTorch tensor (a ``state_dict()``) detached to
    NumPy on the host, bf16 as ``ml_dtypes.bfloat16``; anything else as it is."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(leaf, torch.Tensor):
        return leaf
    tensor = leaf.detach().cpu()
    if tensor.dtype == torch.bfloat16:  # NumPy has no bf16: its bits, viewed as ml_dtypes'
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def flat_arrays(tree: PyTree) -> dict[str, ArrayValue]:
    """``{"a/b": array}`` for a nested dict (or any pytree) of arrays; a flat dict's keys kept."""
    return {leaf_name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


#: PyTorch's pickled files: never read (unpickling runs the file's code)
PICKLES = (".pt", ".pth", ".bin", ".ckpt", ".pkl")
#: what every refusal of a source says to pass
KINDS = "a .safetensors file, a folder of them, an orbax checkpoint of a params tree, a .npz or a dict of arrays"


def _checkpoint_steps(path: str) -> list[str]:
    """The step folders of a trainkit checkpoint at ``path`` (a step folder with ``state`` and
    ``meta``, or a folder of such steps), oldest first; empty for anything else."""
    parent = os.path.dirname(os.path.normpath(path))
    if os.path.basename(os.path.normpath(path)) == "state" and os.path.isdir(os.path.join(parent, "meta")):
        path = parent  # a step's "state" item: the step itself
    steps = [path, *(os.path.join(path, name) for name in sorted(os.listdir(path), key=_step_number) if name.isdigit())]
    return [
        step
        for step in steps
        if os.path.isdir(os.path.join(step, "state")) and os.path.isdir(os.path.join(step, "meta"))
    ]


def _step_number(name: str) -> int:
    return int(name) if name.isdigit() else -1


def _checkpoint_variables(path: str) -> OrbaxSource:
    """The variables of a trainkit checkpoint's latest step (its parameters by path, its model state
    as ``batch_stats/...``), read as published weights: a frozen teacher's sub-tree."""
    step = _checkpoint_steps(path)[-1]
    roots = {"params/": "", "model_state/": ""}
    return OrbaxSource(os.path.join(step, "state"), f"the trainkit checkpoint {step}", roots=roots)


class NpzSource:
    """A ``.npz``: its members' shapes and dtypes read from their headers alone, and a member's
    values read only when a variable asks for it (an unused 1 GiB entry costs nothing)."""

    def __init__(self, path: str):
        self.path, self.description = path, path
        self.entries: dict[str, Entry] = {}
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                with archive.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    read = (
                        np.lib.format.read_array_header_1_0
                        if version == (1, 0)
                        else np.lib.format.read_array_header_2_0
                    )
                    shape, _, dtype = read(member)
                if dtype.hasobject:  # never unpickled
                    raise ValueError("Object arrays cannot be loaded when allow_pickle=False")
                self.entries[info.filename[: -len(".npy")]] = Entry(tuple(shape), np.dtype(dtype))
        self._read: dict[str, np.ndarray] = {}

    def read(self, name: str, index: Index) -> np.ndarray:
        if name not in self._read:
            with np.load(self.path) as archive:  # allow_pickle=False
                self._read[name] = archive[name]
        return self._read[name][index]


def _npz_source(path: str) -> NpzSource:
    try:
        return NpzSource(path)
    except Exception as error:  # noqa: BLE001 - zipfile, numpy and OS errors alike: one message
        raise WeightFileError(
            f"{path} is not a readable .npz of arrays ({type(error).__name__}: {error}). Nothing was loaded; "
            "write it again with np.savez(path, **arrays) (numbers only: object arrays are not read)."
        ) from None


def _indexed_source(path: str) -> SafetensorsSource:
    """A Hugging Face folder's sharded weights, read through its ``model.safetensors.index.json``: the
    files its ``weight_map`` names (and no other ``.safetensors`` of the folder, such as an adapter's),
    each holding the entries the index says it holds."""
    index = os.path.join(path, INDEX)
    try:
        with open(index) as file:
            weight_map = json.load(file)["weight_map"]
        shards = dict(weight_map)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise _refuse(index, f"it is not an index of shards with a weight_map ({type(error).__name__})") from None
    except RecursionError:  # nested deeper than Python's parser goes
        raise _refuse(index, "its JSON is nested too deeply to be an index of shards") from None
    outside = sorted({repr(shard) for shard in shards.values() if not _plain_name(shard)})
    if outside:
        raise _refuse(
            index, f"its weight_map names {', '.join(outside[:3])}: a shard is a file name inside the folder, as "
            "transformers requires (no folder, '..' or absolute path)",
        )  # fmt: skip
    files = {name: os.path.join(path, shard) for name, shard in shards.items()}
    missing = sorted({shard for shard in files.values() if not os.path.lexists(shard)})
    if missing:
        raise _refuse(index, f"it names shards the folder lacks: {', '.join(map(os.path.basename, missing))}")
    _check_regular(sorted(set(files.values())))
    source = SafetensorsSource(sorted(set(files.values())), f"{path} ({len(set(files.values()))} shards by its index)")
    wrong = sorted(name for name, shard in files.items() if source.shard_of(name) != shard)
    if wrong:
        raise _refuse(index, f"its weight_map puts {', '.join(wrong[:5])} in shards that do not hold them")
    return source


def _plain_name(shard: object) -> bool:
    """Whether ``shard`` names a file of the folder itself: no separator, not ``.`` or ``..``."""
    separators = {os.sep, os.altsep or os.sep, "/", "\\"}
    return isinstance(shard, str) and shard not in ("", ".", "..") and not any(s in shard for s in separators)


def _check_regular(files: list[str]) -> None:
    """Refuses a file of a folder that is, or links to, something other than a regular file (a
    device, a pipe, a folder), before it is opened. A link to a regular file is read wherever it
    leads: a Hugging Face cache's snapshot links each file to its blob (``../../blobs/<sha>``)."""
    odd = [name for name in files if not os.path.isfile(name)]  # isfile follows links: a regular file only
    if odd:
        target = os.path.realpath(odd[0])
        raise WeightFileError(
            f"{odd[0]} {'links to ' + target + ', which' if target != os.path.abspath(odd[0]) else ''} is not a "
            "regular file (a device, a pipe or a folder): trainkit reads weights from regular files alone. Nothing "
            "was loaded; point the name at the weights file itself."
        )


def _folder_source(path: str, checkpoints: bool = False) -> WeightSource:
    if os.path.isfile(os.path.join(path, INDEX)):  # a Hugging Face folder of shards
        return _indexed_source(path)
    if os.path.isfile(os.path.join(path, WEIGHTS)):  # a Hugging Face folder's weights (not its adapter's)
        _check_regular([os.path.join(path, WEIGHTS)])
        return SafetensorsSource([os.path.join(path, WEIGHTS)], os.path.join(path, WEIGHTS))
    shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if shards:
        _check_regular(shards)
        return SafetensorsSource(shards, f"{path} ({len(shards)} safetensors shards)")
    if _checkpoint_steps(path) and checkpoints:
        return _checkpoint_variables(path)
    if _checkpoint_steps(path):
        raise WeightFileError(
            f"{path} is a trainkit checkpoint (a training state and its manifest), not published weights: "
            f"load it with trainer.load({path!r}) (after trainer.init(sample_batch)); or its variables into a "
            f"sub-tree of another model with tk.weights.load({path!r}, into=trainer, prefix='teacher/')."
        )
    try:
        return OrbaxSource(path, path)
    except Exception as error:  # noqa: BLE001 - orbax raises many kinds for a folder that is not its
        found = sorted(os.listdir(path))
        held = f"it holds {', '.join(found[:5])}{', ...' if len(found) > 5 else ''}" if found else "it is empty"
        raise WeightFileError(
            f"No weights in the folder {path} ({held}; no .safetensors file, and orbax cannot read it as a "
            f"checkpoint: {type(error).__name__}). Pass {KINDS}."
        ) from None


#: What ``tk.weights.load`` reads: a path (file or folder) or a dict of arrays (nested, or flat by name).
SourceSpec = LocalPath | Mapping[str, PyTree]


def open_source(source: SourceSpec, checkpoints: bool = False) -> WeightSource:
    """The source of ``source``: a path (``.safetensors`` file, folder of shards, orbax
    checkpoint folder, ``.npz``) or a dict of arrays (nested, or flat with ``/`` names). A file or
    folder that cannot be trusted raises :class:`WeightFileError` naming it, before anything is read.
    ``checkpoints``: a trainkit checkpoint's variables are a source too (else refused: the whole
    model is restored with ``trainer.load``)."""
    if isinstance(source, Mapping):
        return ArraySource({name: host_array(a) for name, a in flat_arrays(source).items()}, "a dict of arrays")
    path = require_local(source, "tk.weights.load's source")
    if not os.path.exists(path):
        raise FileNotFoundError(f"No weights at {path!r}: pass {KINDS}.")
    if os.path.isdir(path):
        return _folder_source(path, checkpoints)
    if path.endswith(".npz"):
        return _npz_source(path)
    if path.lower().endswith(PICKLES):
        raise WeightFileError(
            f"{path} is a PyTorch pickle, which trainkit does not read (unpickling runs code from the file). Convert "
            "it once: safetensors.torch.save_file(torch.load(path, weights_only=True), 'model.safetensors'), then "
            "load that (layout='torch' translates PyTorch's names and layouts)."
        )
    return SafetensorsSource([path], path)
