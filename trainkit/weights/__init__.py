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
from typing import NamedTuple, Protocol, overload

import jax
import jax.numpy as jnp
import numpy as np

from trainkit import distributed
from trainkit.core.local_path import require_local
from trainkit.core.tree import ArrayValue, Leaf, PyTree, leaf_name
from trainkit.core.warn import warn_user
from trainkit.distributed import atomic
from trainkit.weights import torch_layout
from trainkit.weights.load import Target, check_options, match, place, refuse
from trainkit.weights.report import LoadReport
from trainkit.weights.sources import PICKLES, SourceSpec, WeightFileError, open_source

__all__ = ["load", "save", "LoadReport", "Loaded", "Target", "Loadable", "WeightFileError"]

logger = logging.getLogger("trainkit")


class Loadable(Protocol):
    """What holds a trainer's variables for loading and saving (its ``state_access``): the variables by
    name as targets, the loaded arrays put in, the host values by name."""

    def weight_targets(self) -> dict[str, Target]: ...

    def put_weights(self, arrays: dict[str, ArrayValue], source: str = "") -> None: ...

    def named_weights(self) -> dict[str, np.ndarray]: ...


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
    holder.put_weights(arrays, opened.description)
    return report


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
    path: str | os.PathLike[str],
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
    check_options(layout, rename, ())
    named = {name: named[full] for name, full in under_prefix(named, prefix).items()}
    import safetensors.numpy

    arrays: dict[str, np.ndarray] = {}
    for name, value in named.items():
        mapped = torch_layout.to_torch(name, np.ndim(value)) if layout == "torch" else torch_layout.Mapped(name, None)
        value = np.asarray(value) if mapped.axes is None else np.transpose(value, mapped.axes)
        arrays[mapped.name] = np.ascontiguousarray(value)
        if layout == "torch" and name.startswith("batch_stats/") and name.endswith("/mean"):
            arrays[mapped.name.replace("running_mean", "num_batches_tracked")] = np.zeros((), np.int64)
    for pattern, replacement in rename:
        arrays = {re.sub(pattern, replacement, name): value for name, value in arrays.items()}
    if not distributed.is_main_process():
        return
    metadata = {"format": "pt" if layout == "torch" else "flax", "writer": "trainkit"}
    with atomic.staged(path, sidecars=()) as temporary:
        safetensors.numpy.save_file(arrays, temporary, metadata=metadata)
