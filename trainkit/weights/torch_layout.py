"""PyTorch's names and layouts against Flax's, both ways: ``Linear.weight`` (out, in) is a
Dense ``kernel`` (in, out); ``Conv{1,2,3}d.weight`` (O, I, *spatial) a Conv ``kernel``
(*spatial, I, O); a norm layer's ``weight`` its ``scale``; ``Embedding.weight`` an
``embedding`` as is; ``BatchNorm``'s ``running_mean`` / ``running_var`` the ``batch_stats``
collection's ``mean`` / ``var``; ``num_batches_tracked`` has no Flax counterpart.

>>> targets = {"fc/kernel": (3, 2), "fc/bias": (2,), "bn/scale": (4,), "batch_stats/bn/mean": (4,)}
>>> [from_torch(n, targets) for n in ("fc.weight", "bn.weight", "bn.running_mean", "bn.num_batches_tracked")]
... # doctest: +NORMALIZE_WHITESPACE
[Mapped(name='fc/kernel', axes=(1, 0)), Mapped(name='bn/scale', axes=None),
 Mapped(name='batch_stats/bn/mean', axes=None), None]
>>> to_torch("fc/kernel", 2), to_torch("batch_stats/bn/var", 1)
(Mapped(name='fc.weight', axes=(1, 0)), Mapped(name='bn.running_var', axes=None))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

#: torch leaves that have no Flax counterpart (read and left out)
IGNORED = ("num_batches_tracked",)
#: Flax leaves a torch ``weight`` may be, in the order they are looked for
WEIGHT_LEAVES = ("kernel", "scale", "embedding")
STATISTICS = {"running_mean": "mean", "running_var": "var"}


class Mapped(NamedTuple):
    """Where an entry goes: its name on the other side, and ``axes`` (``np.transpose``'s) that
    take its array to the other side's layout (``None``: as it is)."""

    name: str
    axes: tuple[int, ...] | None


def kernel_axes(ndim: int) -> tuple[int, ...] | None:
    """torch's weight layout -> Flax's kernel layout: (out, in) -> (in, out); (O, I, *spatial)
    -> (*spatial, I, O)."""
    if ndim < 2:
        return None
    return (1, 0) if ndim == 2 else (*range(2, ndim), 1, 0)


def inverse(axes: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The axes that undo a transpose by ``axes``."""
    return None if axes is None else tuple(sorted(range(len(axes)), key=axes.__getitem__))


def from_torch(name: str, targets: Mapping[str, tuple[int, ...]]) -> Mapped | None:
    """The Flax name (and transpose) of a torch state-dict entry, looked up among ``targets``
    (Flax names to shapes; params without a prefix, other collections with theirs) where torch's
    name alone is ambiguous (a ``weight``); ``None`` for an entry Flax has no place for."""
    module, _, leaf = name.rpartition(".")
    path = module.replace(".", "/")
    prefix = f"{path}/" if path else ""
    if leaf in IGNORED:
        return None
    if leaf in STATISTICS:
        return Mapped(f"batch_stats/{prefix}{STATISTICS[leaf]}", None)
    if leaf != "weight":
        return Mapped(prefix + leaf, None)
    for flax_leaf in WEIGHT_LEAVES:
        target = prefix + flax_leaf
        if target in targets:
            return Mapped(target, kernel_axes(len(targets[target])) if flax_leaf == "kernel" else None)
    return Mapped(prefix + "kernel", None)  # nowhere to go: reported as unexpected under this name


def to_torch(name: str, ndim: int) -> Mapped:
    """The torch state-dict name (and transpose) of a Flax variable (params without a prefix)."""
    collection, _, rest = name.partition("/")
    if collection == "batch_stats":
        module, _, leaf = rest.rpartition("/")
        torch_leaf = {value: key for key, value in STATISTICS.items()}.get(leaf, leaf)
        return Mapped(f"{module.replace('/', '.')}.{torch_leaf}".lstrip("."), None)
    module, _, leaf = name.rpartition("/")
    prefix = f"{module.replace('/', '.')}." if module else ""
    if leaf == "kernel":
        return Mapped(prefix + "weight", inverse(kernel_axes(ndim)))
    if leaf in WEIGHT_LEAVES:
        return Mapped(prefix + "weight", None)
    return Mapped(prefix + leaf, None)
