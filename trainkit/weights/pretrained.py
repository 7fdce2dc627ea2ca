"""A Hugging Face folder out (``trainer.save_pretrained``): what ``transformers``' ``from_pretrained``
and vLLM's ``LLM(model=folder)`` read as it is. ``config.json`` with ``model_type``, ``architectures``
and ``dtype``; the weights as safetensors (``format: pt`` metadata), sharded past ``max_shard_size``
with ``model.safetensors.index.json``; the base folder's tokenizer and generation files beside; or,
for LoRA's adapters, a PEFT folder (:mod:`trainkit.weights.peft_adapter`). Checked against the
architecture before anything is written where ``transformers`` is installed
(:mod:`trainkit.weights.architecture`); written whole or not at all.

>>> shard_size("5GB"), shard_size("2MiB"), shard_size(1000)
(5000000000, 2097152, 1000)
>>> [sorted(s) for s in shards({"a": np.zeros(100, np.float32), "b": np.zeros(100, np.float32)}, 500)]
[['a'], ['b']]
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Mapping
from typing import Any, Protocol, TypeGuard

import numpy as np

from trainkit import distributed
from trainkit.core.local_path import LocalPath, require_local
from trainkit.distributed import atomic

#: What a base model's folder holds besides its weights that a fine-tuned folder takes as it is
#: (``tokenizer=``): the tokenizer's files, its chat template, the generation defaults.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
WEIGHTS, INDEX, README = "model.safetensors", "model.safetensors.index.json", "README.md"
#: The names a folder ``save_pretrained`` wrote may hold: an existing folder holding only these is replaced.
FOLDER_FILES = re.compile(
    r"^(config\.json|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|adapter_config\.json"
    r"|adapter_model\.safetensors|README\.md|" + "|".join(re.escape(name) for name in TOKENIZER_FILES) + ")$"
)
#: A ``config.json`` as ``json`` reads it: each entry of the JSON type ``transformers`` gave it.
Config = dict[str, Any]
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def shard_size(size: int | str) -> int:
    """Bytes from ``max_shard_size``: a number, or ``"5GB"`` / ``"500MB"`` (powers of 10, as
    ``transformers`` reads them) / ``"2GiB"`` (powers of 2)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)\s*", str(size), re.I)
    if found is None or float(found[1]) <= 0:
        raise ValueError(f"max_shard_size={size!r}: pass a positive number of bytes or a size such as '5GB' or '2GiB'.")
    return int(float(found[1]) * _UNITS[found[2].upper()])


def shards(arrays: Mapping[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
    """The arrays in order, cut into shards of at most ``max_bytes`` each (an array larger than that
    one shard alone), as ``transformers`` shards a checkpoint."""
    cut: list[dict[str, np.ndarray]] = [{}]
    used = 0
    for name, array in arrays.items():
        if cut[-1] and used + array.nbytes > max_bytes:
            cut.append({})
            used = 0
        cut[-1][name] = array
        used += array.nbytes
    return cut


def read_config(config: object) -> tuple[Config, str | None]:
    """``(config as a dict, the base folder it came from or None)`` from a folder holding
    ``config.json``, the file itself, a dict or a ``transformers`` config object; refused without
    ``model_type`` and ``architectures`` (readers pick the model class by them)."""
    folder = None
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        folder, path = (path, os.path.join(path, "config.json")) if os.path.isdir(path) else (None, path)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"config={config!r}: no config.json there. Pass the base model's folder or its config.json."
            )
        with open(path) as file:
            try:
                read = json.load(file)
            except (ValueError, RecursionError) as error:
                raise ValueError(f"config={config!r}: {path} is not a JSON config ({type(error).__name__}).") from None
    elif isinstance(config, Mapping):
        read = dict(config)
    elif _is_transformers_config(config):
        read = config.to_dict()
    else:
        raise TypeError(
            f"config= takes the base model's folder, its config.json, a dict or a transformers config; received "
            f"{type(config).__name__}."
        )
    missing = [key for key in ("model_type", "architectures") if not read.get(key)]
    if missing or not isinstance(read["architectures"], list):
        raise ValueError(
            f"The config has no {' and no '.join(missing) or 'list of architectures'}: transformers' Auto classes "
            "and vLLM choose the model class by them. Nothing was written; set them, e.g. "
            "config['model_type'] = 'llama' and config['architectures'] = ['LlamaForCausalLM']."
        )
    return read, folder


class _TransformersConfig(Protocol):
    def to_dict(self) -> Config: ...


def _is_transformers_config(config: object) -> TypeGuard[_TransformersConfig]:
    transformers = sys.modules.get("transformers")  # an object of its type implies it was imported
    return transformers is not None and isinstance(config, transformers.PretrainedConfig)


def _floating(array: np.ndarray) -> bool:
    """Whether ``array`` holds floats, bf16 (an ``ml_dtypes`` type NumPy does not count as floating) too."""
    return bool(np.issubdtype(array.dtype, np.floating)) or array.dtype.name == "bfloat16"


def dtype_name(arrays: Mapping[str, np.ndarray]) -> str:
    """The floating dtype the weights are written in (``"float32"``, ``"bfloat16"``), for ``config.json``."""
    floating = [a.dtype for a in arrays.values() if _floating(a)]
    return str(floating[0]) if floating else "float32"


#: ``save_pretrained(dtype=...)``'s spellings of the dtypes it writes: NumPy's, the usual short ones, torch's
DTYPES = {
    name: canonical
    for canonical, names in {
        "bfloat16": ("bfloat16", "bf16", "torch.bfloat16"),
        "float16": ("float16", "fp16", "half", "torch.float16", "torch.half"),
        "float32": ("float32", "fp32", "float", "torch.float32", "torch.float"),
    }.items()
    for name in names
}


def dtype_of(dtype: object) -> str:
    """The dtype ``save_pretrained(dtype=...)`` names, by any spelling in :data:`DTYPES` (a torch dtype
    or a NumPy one too).

    >>> dtype_of("bf16"), dtype_of(np.float16)
    ('bfloat16', 'float16')
    >>> dtype_of(5)
    Traceback (most recent call last):
    ValueError: dtype=5 is not a floating dtype save_pretrained writes: pass 'bfloat16' (or 'bf16', ...
    """
    spelled = str(dtype) if not isinstance(dtype, type) else np.dtype(dtype).name
    if spelled not in DTYPES:
        raise ValueError(
            f"dtype={dtype!r} is not a floating dtype save_pretrained writes: pass 'bfloat16' (or 'bf16', "
            "torch.bfloat16), 'float16' (or 'fp16') or 'float32' (or 'fp32'); None keeps the trainer's."
        )
    return DTYPES[spelled]


def cast(arrays: Mapping[str, np.ndarray], dtype: object) -> dict[str, np.ndarray]:
    """The floating arrays in ``dtype`` (any spelling :func:`dtype_of` reads); integers as they are."""
    if dtype is None:
        return dict(arrays)
    import ml_dtypes

    name = dtype_of(dtype)
    target = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
    return {name: a.astype(target) if _floating(a) else a for name, a in arrays.items()}


def check_json(config: Config) -> None:
    """Refuses a ``config=`` whose values JSON cannot write (a ``set``), naming the key, before
    anything is written."""
    for key, value in config.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"config= holds {key!r}: {type(value).__name__} ({error}), which config.json cannot hold: give it as "
                "a JSON value (a list for a set, a str, a number, a dict). Nothing was written."
            ) from None


def write_folder(
    folder: LocalPath,
    files: Mapping[str, Mapping[str, np.ndarray]],
    documents: Mapping[str, object],
    copied: Mapping[str, str],
) -> None:
    """The folder written whole or not at all (staged beside it and renamed into place, on the main
    process): ``files`` safetensors files by name (``format: pt`` metadata), ``documents`` JSON files by
    name, ``copied`` files from elsewhere by name. An existing folder is replaced only when it holds
    nothing but what such a folder holds (:data:`FOLDER_FILES`)."""
    path = require_local(folder, "save_pretrained's folder")
    if not distributed.is_main_process():
        return
    import safetensors.numpy

    existing = os.listdir(path) if os.path.isdir(path) else []
    entries = {n for n in existing if FOLDER_FILES.match(n)}
    if README in existing and README not in copied:  # a model card trainkit did not write: kept
        copied = {**copied, README: os.path.join(path, README)}
    with atomic.staged(path, sidecars=(), folder_entries=entries, folder="save_pretrained's folder") as staging:
        os.makedirs(staging)
        for name, arrays in files.items():
            safetensors.numpy.save_file(dict(arrays), os.path.join(staging, name), metadata={"format": "pt"})
        for name, document in documents.items():
            with open(os.path.join(staging, name), "w") as file:
                json.dump(document, file, indent=2, sort_keys=True)
                file.write("\n")
        for name, source in copied.items():
            shutil.copyfile(source, os.path.join(staging, name))


def weight_files(
    arrays: Mapping[str, np.ndarray], max_shard_size: int | str
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, object]]:
    """``(safetensors files by name, documents by name)``: ``model.safetensors`` alone, or the shards
    ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json`` (``total_size``, ``weight_map``)."""
    cut = shards(arrays, shard_size(max_shard_size))
    if len(cut) == 1:
        return {WEIGHTS: cut[0]}, {}
    names = [f"model-{k + 1:05d}-of-{len(cut):05d}.safetensors" for k in range(len(cut))]
    weight_map = {entry: name for name, part in zip(names, cut) for entry in part}
    total = int(sum(a.nbytes for a in arrays.values()))
    return dict(zip(names, cut)), {INDEX: {"metadata": {"total_size": total}, "weight_map": weight_map}}


def check_not_a_source(folder: LocalPath, sources: Mapping[str, object]) -> None:
    """Refuses to write where a source lies: a path ``sources`` names by argument (``config=`` as a
    folder or its ``config.json``, ``tokenizer=``, the weights the trainer was loaded from) that is the
    target folder, inside it or above it. The published base would be replaced by the fine-tuned one
    (or the fine-tuned one written inside it).

    >>> check_not_a_source("base", {"config=": "base/config.json"})
    Traceback (most recent call last):
    ValueError: save_pretrained would write 'base', which holds what config= reads ('base/config.json'): ...
    """
    target = os.path.realpath(os.fspath(folder))
    for argument, source in sources.items():
        if not isinstance(source, (str, os.PathLike)):
            continue  # a dict or a transformers config: no file
        path = os.path.realpath(os.fspath(source))
        home = path if os.path.isdir(path) or not os.path.exists(path) else os.path.dirname(path)  # a file: its folder
        inside, above = _under(path, target), _under(target, home)  # the folder read is above the target
        if path == target or inside or above:
            where = "is" if path == target else "holds" if inside else "lies inside"
            raise ValueError(
                f"save_pretrained would write {os.fspath(folder)!r}, which {where} what {argument} reads "
                f"({os.fspath(source)!r}): the published base there would be replaced (or the fine-tuned model "
                "written into it). Nothing was written; name a new folder beside it."
            )


def _under(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip(os.sep) + os.sep)


def tokenizer_files(tokenizer: LocalPath | None) -> dict[str, str]:
    """The tokenizer and generation files of the base folder ``tokenizer`` by name (none for ``None``);
    refused when the folder holds none of them."""
    if tokenizer is None:
        return {}
    folder = os.fspath(tokenizer)
    found = {name: os.path.join(folder, name) for name in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, name))}
    if not found:
        raise FileNotFoundError(
            f"tokenizer={folder!r} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...). Pass the base "
            "model's folder (the one from_pretrained read), or tokenizer=None."
        )
    return found
