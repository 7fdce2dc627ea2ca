"""Published weights in and out: ``tk.weights.load(source, into=trainer)`` reads a safetensors
file or folder of shards, an orbax checkpoint of a params tree, a ``.npz`` or a dict of arrays
into a trainer's variables (each device's shard read by itself, in the trainer's shardings),
after a report of what matched; ``trainer.save_weights(path)`` writes them as safetensors
(``layout="torch"``: PyTorch's names and layouts). See docs/finetuning.md.

>>> import numpy as np
>>> loaded = load({"fc.weight": np.ones((2, 3), np.float32)}, into={"fc": {"kernel": np.zeros((3, 2), np.float32)}},
...               layout="torch")
>>> loaded.tree["fc"]["kernel"].shape, loaded.report.loaded
((3, 2), ('fc/kernel',))
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol, TypedDict, overload

import jax
import jax.numpy as jnp
import numpy as np

from trainkit import distributed
from trainkit.core.local_path import LocalPath, require_local
from trainkit.core.lora import LoRA
from trainkit.core.tree import ArrayValue, Leaf, PyTree, leaf_name
from trainkit.core.warn import warn_user
from trainkit.distributed import atomic
from trainkit.weights import architecture, peft_adapter, pretrained, torch_layout
from trainkit.weights.load import Target, check_options, match, place, refuse
from trainkit.weights.report import LoadReport
from trainkit.weights.sources import PICKLES, SourceSpec, WeightFileError, open_source

__all__ = [
    "load",
    "copy",
    "save",
    "save_pretrained",
    "Pretrained",
    "LoadReport",
    "Loaded",
    "Target",
    "Loadable",
    "WeightFileError",
]

logger = logging.getLogger("trainkit")


class Loadable(Protocol):
    """What holds a trainer's variables for loading and saving (its ``state_access``): the variables by
    name as targets, the loaded arrays put in, the host values by name."""

    def weight_targets(self) -> dict[str, Target]: ...

    def put_weights(self, arrays: dict[str, ArrayValue], source: str = "", path: str | None = None) -> None: ...

    #: the file or folder the variables were last loaded from (``None``: none, or a dict of arrays)
    loaded_path: str | None

    def named_weights(self) -> dict[str, np.ndarray]: ...


class Pretrainable(Loadable, Protocol):
    """What :func:`save_pretrained` reads: the variables by name, and LoRA's settings and adapters."""

    def named_adapters(self) -> tuple[LoRA, dict[str, np.ndarray]]: ...


class WeightsFile(TypedDict, total=False):
    """``trainer.save_weights``'s options besides the path (:func:`save`)."""

    format: str
    layout: str
    rename: Sequence[tuple[str, str]]
    prefix: str


class Pretrained(TypedDict, total=False):
    """``trainer.save_pretrained``'s options besides the folder and ``config`` (:func:`save_pretrained`)."""

    rename: Sequence[tuple[str, str]]
    layout: str
    dtype: object
    max_shard_size: int | str
    tokenizer: LocalPath | None
    adapter: bool


class HasStateAccess(Protocol):
    """A :class:`trainkit.Trainer` as this module sees it."""

    state_access: Loadable


class Loaded(NamedTuple):
    """:func:`load` into a tree: the tree with the loaded leaves replaced, and the report."""

    tree: PyTree
    report: LoadReport


@overload
def load(
    source: SourceSpec,
    into: HasStateAccess,
    *,
    rename: Sequence[tuple[str, str]] = (),
    layout: str = "flax",
    strict: bool = True,
    keep_initial: Sequence[str] = (),
    as_is: Sequence[str] = (),
    prefix: str = "",
) -> LoadReport: ...


@overload
def load(
    source: SourceSpec,
    into: Mapping[str, Leaf],
    *,
    rename: Sequence[tuple[str, str]] = (),
    layout: str = "flax",
    strict: bool = True,
    keep_initial: Sequence[str] = (),
    as_is: Sequence[str] = (),
    prefix: str = "",
) -> Loaded: ...


def load(
    source: SourceSpec,
    into: HasStateAccess | Mapping[str, Leaf],
    *,
    rename: Sequence[tuple[str, str]] = (),
    layout: str = "flax",
    strict: bool = True,
    keep_initial: Sequence[str] = (),
    as_is: Sequence[str] = (),
    prefix: str = "",
) -> LoadReport | Loaded:
    """Loads ``source`` into a trainer's variables (call ``trainer.init(sample)`` first) and
    returns the :class:`LoadReport`; or into a tree of arrays or ``jax.ShapeDtypeStruct`` (with
    shardings: placed in them; without: NumPy) and returns :class:`Loaded`.

    Variables are named by their paths: ``Dense_0/kernel`` for parameters, ``batch_stats/bn/mean``
    for other collections. ``rename``: ``(regex, replacement)`` pairs applied in order to each
    source name; ``layout="torch"``: PyTorch's names and layouts translated; ``strict``: refuse
    (naming each) missing, unexpected and reshaped entries and casts that lose values, before
    anything is read; ``keep_initial``: regexes of variables left at their initial values (a new
    head), whatever the source has for them; ``as_is``: regexes of source entries that
    ``layout="torch"`` loads untransposed (Hugging Face's ``Conv1D``: see docs/finetuning.md);
    ``prefix``: load into the sub-tree of that path alone (``"teacher/"``: a frozen teacher's
    parameters and its ``batch_stats/teacher/...``), its names without the prefix matched against
    the source's, which may then also be a trainkit checkpoint (its latest step's variables); every
    other variable is left as it is (docs/custom_training.md)."""
    opened = open_source(source, checkpoints=bool(prefix))  # a trainkit checkpoint's variables: into a sub-tree
    if isinstance(into, Mapping):
        leaves = {leaf_name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(into)}
        targets = {name: _target(leaf) for name, leaf in leaves.items()}
    else:
        try:
            holder = into.state_access
        except AttributeError:
            raise TypeError(
                f"into= takes a trainkit.Trainer or a tree (dict) of arrays; received {type(into).__name__}."
            ) from None
        targets = holder.weight_targets()
    full_names = under_prefix(targets, prefix)
    targets = {name: targets[full] for name, full in full_names.items()}
    report, reads = match(opened, targets, rename=rename, layout=layout, keep_initial=keep_initial, as_is=as_is)
    if strict:
        refuse(report, opened.description)
    elif report.problems():
        logger.warning("Loading %s with strict=False: %s", opened.description, report)
    arrays = {full_names[name]: array for name, array in place(opened, reads, targets).items()}
    report = dataclasses.replace(report, non_finite=non_finite(arrays))
    if report.non_finite:
        warn_user(f"{opened.description} holds NaN or Inf in {', '.join(report.non_finite)}: loaded as they are.")
    logger.info("Loaded %s: %s", opened.description, report)
    if isinstance(into, Mapping):
        flat = jax.tree_util.tree_leaves_with_path(into)
        values = [arrays.get(leaf_name(path), leaf) for path, leaf in flat]
        return Loaded(jax.tree.unflatten(jax.tree.structure(into), values), report)
    holder.put_weights(arrays, opened.description, None if isinstance(source, Mapping) else os.fspath(source))
    return report


def copy(trainer: HasStateAccess, *, source: str, into: str) -> LoadReport:
    """Copies a trainer's variables under ``source`` (``"policy/"``) into those under ``into``
    (``"reference/"``), by their names below each prefix (parameters and other collections, e.g.
    ``batch_stats/policy/...``), as strictly as :func:`load` (every name matched, the same
    shapes); every other variable left as it is. A reference model for DPO or a KL penalty, an
    EMA target, a teacher distilled from a copy: frozen by ``trainable=`` as any sub-module
    (docs/custom_training.md).

    >>> import flax.linen as nn, jax.numpy as jnp, numpy as np, optax, trainkit as tk
    >>> class Pair(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return nn.Dense(2, name="policy")(x) - nn.Dense(2, name="reference")(x)
    >>> trainer = tk.Trainer(Pair(), loss="mse", optimizer=optax.sgd(0.1), strategy="single", trainable=r"^policy/")
    >>> _ = trainer.init((np.ones((4, 3), np.float32), np.ones((4, 2), np.float32)))
    >>> report = copy(trainer, source="policy/", into="reference/")
    >>> np.array_equal(trainer.params["policy"]["kernel"], trainer.params["reference"]["kernel"])
    True
    """
    named = trainer.state_access.named_weights()
    return load({short: named[full] for short, full in under_prefix(named, source).items()}, into=trainer, prefix=into)


def under_prefix(names: Mapping[str, object], prefix: str) -> dict[str, str]:
    """The variable names under ``prefix`` without it, each to its full name: a parameter's path
    (``teacher/Dense_0/kernel``) or another collection's (``batch_stats/teacher/bn/mean``); every
    name as it is for ``""``. Raises when nothing is under the prefix.

    >>> under_prefix({"teacher/fc/kernel": 0, "student/fc/kernel": 0, "batch_stats/teacher/bn/mean": 0}, "teacher/")
    {'fc/kernel': 'teacher/fc/kernel', 'batch_stats/bn/mean': 'batch_stats/teacher/bn/mean'}
    """
    if not prefix:
        return {name: name for name in names}
    found: dict[str, str] = {}
    for name in names:
        collection, _, rest = name.partition("/")
        if name.startswith(prefix):
            found[name[len(prefix) :]] = name
        elif rest.startswith(prefix):
            found[f"{collection}/{rest[len(prefix) :]}"] = name
    if not found:
        tops = sorted({name.split("/")[0] + "/" for name in names})
        raise ValueError(f"prefix={prefix!r} names no variable: the variables' paths begin with {tops}.")
    return found


def non_finite(arrays: Mapping[str, ArrayValue]) -> tuple[str, ...]:
    """The names of the floating arrays holding a NaN or an infinity."""
    floating = {name: a for name, a in arrays.items() if jnp.issubdtype(jnp.result_type(a), jnp.inexact)}

    def finite(a: ArrayValue) -> bool:  # on the device for placed arrays, on the host for host ones
        return bool(jnp.isfinite(a).all()) if isinstance(a, jax.Array) else bool(np.isfinite(np.asarray(a)).all())

    return tuple(sorted(name for name, a in floating.items() if not finite(a)))


def _target(leaf: Leaf) -> Target:
    sharding = leaf.sharding if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) else None
    return Target(tuple(np.shape(leaf)), np.dtype(leaf.dtype), sharding)


def save(
    named: Mapping[str, np.ndarray],
    path: LocalPath,
    *,
    format: str = "safetensors",
    layout: str = "flax",
    rename: Sequence[tuple[str, str]] = (),
    prefix: str = "",
) -> None:
    """Host arrays by variable name written as one safetensors file (on the main process; the
    file appears whole or not at all). ``layout="torch"`` writes PyTorch's names and layouts
    (with ``num_batches_tracked`` for each BatchNorm), readable by ``load_state_dict``;
    ``rename`` pairs apply to the written names last; ``prefix``: the sub-tree of that path
    alone, written without it (a distilled student: ``"student/"``)."""
    require_local(path, "save_weights' filepath")
    if format != "safetensors":
        raise ValueError(f"format={format!r}: weights are written as 'safetensors'.")
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix in PICKLES:
        raise ValueError(
            f"save_weights writes a safetensors file, but {os.fspath(path)!r} ends in {suffix!r}, which readers take "
            "for a pickle (torch.load would fail on it). Name it .safetensors; in PyTorch, read it with "
            "safetensors.torch.load_file(path) and model.load_state_dict(...)."
        )
    arrays = written_arrays(named, layout=layout, rename=rename, prefix=prefix)
    if not distributed.is_main_process():
        return
    import safetensors.numpy

    metadata = {"format": "pt" if layout == "torch" else "flax", "writer": "trainkit"}
    with atomic.staged(path, sidecars=()) as temporary:
        try:
            safetensors.numpy.save_file(arrays, temporary, metadata=metadata)
        except Exception as error:  # noqa: BLE001 - safetensors' Rust error for an OS one: an OSError for the target
            if "I/O error" not in str(error):
                raise
            raise OSError(f"{error}") from error  # staged() names the target


def written_name(name: str, ndim: int, layout: str, rename: Sequence[tuple[str, str]]) -> torch_layout.Mapped:
    """The name a variable is written under (``layout``'s, then each ``rename`` pair in order) and the
    transpose its array takes (``None``: as it is)."""
    mapped = torch_layout.to_torch(name, ndim) if layout == "torch" else torch_layout.Mapped(name, None)
    return torch_layout.Mapped(_renamed(mapped.name, rename), mapped.axes)


def _renamed(name: str, rename: Sequence[tuple[str, str]]) -> str:
    for pattern, replacement in rename:
        name = re.sub(pattern, replacement, name)
    return name


def written_arrays(
    named: Mapping[str, np.ndarray], *, layout: str = "flax", rename: Sequence[tuple[str, str]] = (), prefix: str = ""
) -> dict[str, np.ndarray]:
    """Host arrays by variable name as :func:`save` writes them: under ``prefix`` alone, in ``layout``'s
    names and layouts (torch's ``num_batches_tracked`` added for each BatchNorm), renamed last."""
    check_options(layout, rename, ())
    named = {name: named[full] for name, full in under_prefix(named, prefix).items()}
    arrays: dict[str, np.ndarray] = {}
    for name, value in named.items():
        mapped = written_name(name, np.ndim(value), layout, rename)
        value = np.asarray(value) if mapped.axes is None else np.transpose(value, mapped.axes)
        if mapped.name in arrays:
            raise ValueError(f"rename writes two variables as {mapped.name!r}: make each pair's result distinct.")
        arrays[mapped.name] = np.ascontiguousarray(value)
        if layout == "torch" and name.startswith("batch_stats/") and name.endswith("/mean"):
            counter = torch_layout.to_torch(name, 1).name.replace("running_mean", "num_batches_tracked")
            arrays[_renamed(counter, rename)] = np.zeros((), np.int64)
    return arrays


def save_pretrained(
    holder: Pretrainable,
    folder: LocalPath,
    *,
    config: object,
    rename: Sequence[tuple[str, str]] = (),
    layout: str = "flax",
    dtype: object = None,
    max_shard_size: int | str = "5GB",
    tokenizer: LocalPath | None = None,
    adapter: bool = False,
) -> None:
    """A folder ``transformers``' ``from_pretrained`` and vLLM read (:mod:`trainkit.weights.pretrained`):
    the variables (LoRA's merged) written as :func:`save` names them (``layout``, then ``rename``), in
    ``dtype``, sharded past ``max_shard_size``, beside ``config``'s ``config.json`` (``dtype`` set) and
    ``tokenizer``'s files; with ``adapter=True`` LoRA's adapters alone as a PEFT folder. Checked against
    the config's architecture first where ``transformers`` is installed; written whole or not at all."""
    folder = require_local(folder, "save_pretrained's folder")  # a URL refused before anything is read
    pretrained.check_not_a_source(
        folder, {"config=": config, "tokenizer=": tokenizer, "tk.weights.load(...)": holder.loaded_path}
    )
    settings, base = pretrained.read_config(config)
    pretrained.check_json(settings)
    if dtype is not None:
        pretrained.dtype_of(dtype)  # a spelling it reads, before anything is fetched
    documents: dict[str, object]
    if adapter:
        lora, adapters = holder.named_adapters()
        arrays, modules = peft_adapter.peft_arrays(
            adapters, lambda name, ndim: written_name(name, ndim, layout, rename).name
        )
        peft_adapter.check_base(holder.loaded_path, base)
        expected = architecture.expected_shapes(settings)
        unknown = [module for module in modules if expected is not None and f"{module}.weight" not in expected]
        if unknown:
            raise ValueError(
                f"The adapters are written for {', '.join(unknown)}, which {settings['architectures'][0]} does not"
                " have (as '<module>.weight'); nothing was written. Fix the rename pairs (or layout) that name the"
                " weights."
            )
        if expected is not None:
            peft_adapter.check_shapes(arrays, modules, expected, transposed=layout != "torch")
        files = {peft_adapter.ADAPTER_WEIGHTS: pretrained.cast(arrays, dtype)}
        documents = {
            peft_adapter.ADAPTER_CONFIG: peft_adapter.peft_config(lora, modules, settings, base, layout != "torch")
        }
    else:
        arrays = pretrained.cast(written_arrays(holder.named_weights(), layout=layout, rename=rename), dtype)
        architecture.check({name: a.shape for name, a in arrays.items()}, settings)
        files, documents = pretrained.weight_files(arrays, max_shard_size)
        settings = {key: value for key, value in settings.items() if key != "torch_dtype"}  # transformers 5: dtype
        documents["config.json"] = {**settings, "dtype": pretrained.dtype_name(arrays)}
    pretrained.write_folder(folder, files, documents, pretrained.tokenizer_files(tokenizer))
