"""Published weights matched to a model's variables by name and placed straight into their
shardings: every entry is matched (renamed, translated from torch's layout), checked and
reported first; only then is anything read, each device's shard from the file.

>>> import numpy as np
>>> from trainkit.weights.sources import open_source
>>> f32 = np.dtype("float32")
>>> targets = {"fc/kernel": Target((3, 2), f32, None), "fc/bias": Target((2,), f32, None)}
>>> source = open_source({"fc.weight": np.ones((2, 3), np.float32), "fc.bias": np.zeros(2, np.float32)})
>>> report, reads = match(source, targets, layout="torch")
>>> report.loaded, place(source, reads, targets)["fc/kernel"].shape
(('fc/bias', 'fc/kernel'), (3, 2))
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from trainkit.core.tree import ArrayValue, Index, Shape
from trainkit.weights import torch_layout
from trainkit.weights.report import LoadReport, loses_values
from trainkit.weights.sources import OrbaxSource, WeightSource

LAYOUTS = ("flax", "torch")


class Target(NamedTuple):
    """A variable to fill: its shape, dtype and sharding (``None``: a host NumPy array)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: jax.sharding.Sharding | None


class Read(NamedTuple):
    """Where a variable's values come from: a source entry, transposed by ``axes`` (``None``: as is)."""

    entry: str
    axes: tuple[int, ...] | None


def check_options(
    layout: str, rename: Sequence[tuple[str, str]], patterns: Sequence[str], argument: str = "keep_initial"
) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}: 'torch' translates PyTorch's names and layouts.")
    for rule in rename:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and all(isinstance(r, str) for r in rule)):
            raise ValueError(f"rename takes (regex, replacement) pairs of strings; received {rule!r}.")
        try:
            re.sub(rule[0], rule[1], "")  # the pattern and the replacement's group references and escapes
        except re.error as error:
            raise ValueError(
                f"rename pair {tuple(rule)!r} is not a valid re.sub pattern and replacement ({error}): a replacement "
                r"refers to the pattern's groups as \1 (or \g<name>) and writes a backslash as \\."
            ) from None
    if isinstance(patterns, str):
        raise ValueError(f"{argument} takes a list of regexes; received the string {patterns!r}: wrap it in [].")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as error:
            raise ValueError(f"{argument}: {pattern!r} is not a regular expression ({error}).") from None


def match(
    source: WeightSource,
    targets: Mapping[str, Target],
    *,
    rename: Sequence[tuple[str, str]] = (),
    layout: str = "flax",
    keep_initial: Sequence[str] = (),
    as_is: Sequence[str] = (),
) -> tuple[LoadReport, dict[str, Read]]:
    """The report of loading ``source`` into ``targets`` and the reads that would do it.
    ``rename``: ``(regex, replacement)`` pairs applied in order (``re.sub``) to each source name,
    before the layout's translation; ``keep_initial``: regexes (``re.search``) of variables left
    at their initial values, whatever the source has for them, each matching one at least;
    ``as_is``: regexes of source entries (their names in the file) that ``layout="torch"``
    loads in their stored layout (Hugging Face's ``Conv1D`` weights are ``(in, out)``, as Flax's)."""
    check_options(layout, rename, keep_initial)
    check_options(layout, (), as_is, argument="as_is")
    rules = [(re.compile(pattern), replacement) for pattern, replacement in rename]
    keep = [re.compile(pattern) for pattern in keep_initial]
    stored = [re.compile(pattern) for pattern in as_is]
    shapes = {name: target.shape for name, target in targets.items()}
    reads: dict[str, Read] = {}
    unexpected, unmatched, ignored, mismatched, casts, lossy, square = [], [], [], [], [], [], []
    for original, entry in source.entries.items():
        name = original
        for pattern, replacement in rules:
            name = pattern.sub(replacement, name)
        mapped = torch_layout.from_torch(name, shapes) if layout == "torch" else torch_layout.Mapped(name, None)
        if mapped is None:
            ignored.append(original)
            continue
        if mapped.axes is not None and any(p.search(original) for p in stored):
            mapped = torch_layout.Mapped(mapped.name, None)
        target = targets.get(mapped.name)
        if target is None:
            unexpected.append(original)
            unmatched.append(mapped.name)
            continue
        if any(k.search(mapped.name) for k in keep):
            continue
        if mapped.name in reads:
            raise ValueError(
                f"Two source entries fill {mapped.name}: {reads[mapped.name].entry!r} and {original!r}. "
                "Change rename= so that each variable has one source entry."
            )
        if mapped.axes is not None and len(entry.shape) != len(mapped.axes):  # no transpose fits: as stored
            mismatched.append((mapped.name, entry.shape, target.shape))
            continue
        shape = entry.shape if mapped.axes is None else tuple(entry.shape[a] for a in mapped.axes)
        if shape != target.shape:
            mismatched.append((mapped.name, entry.shape, target.shape))  # the source's shape as stored
            continue
        if mapped.axes is not None and len(shape) == 2 and shape[0] == shape[1]:
            square.append(original)  # transposed, and no shape can tell whether it should be
        if entry.dtype != target.dtype:
            casts.append((mapped.name, str(entry.dtype), str(target.dtype)))
            if loses_values(entry.dtype, target.dtype):
                lossy.append(mapped.name)
        reads[mapped.name] = Read(original, mapped.axes)
    kept = _kept(keep, targets)
    settled = set(reads) | set(kept) | {name for name, _, _ in mismatched}
    missing = [name for name in targets if name not in settled]
    report = LoadReport(
        loaded=tuple(sorted(reads)),
        missing=tuple(missing),
        unexpected=tuple(unexpected),
        mismatched=tuple(mismatched),
        casts=tuple(casts),
        lossy=tuple(lossy),
        kept_initial=tuple(kept),
        ignored=tuple(ignored),
        hint=_rename_hint(unmatched, missing) or _as_is_hint(mismatched, layout),
        transposed_square=tuple(square),
    )
    return report, reads


def _kept(keep: list[re.Pattern[str]], targets: Mapping[str, Target]) -> list[str]:
    """The variables ``keep_initial`` keeps; a pattern matching none is refused (a typo would load
    the published head where a new one was meant)."""
    for pattern in keep:
        if not any(pattern.search(name) for name in targets):
            examples = ", ".join(list(targets)[:6])
            raise ValueError(
                f"keep_initial={pattern.pattern!r} matches none of the model's variables, so the source would fill "
                f"what it meant to keep new. Its variables are named like: {examples} (re.search on these names)."
            )
    return [name for name in targets if any(k.search(name) for k in keep)]


def _as_is_hint(mismatched: list[tuple[str, Shape, Shape]], layout: str) -> str:
    """Under ``layout="torch"``: when 2-D entries would fit as stored (``(in, out)``, as Hugging
    Face's ``Conv1D`` stores them), how to load them that way."""
    stored = [name for name, source, model in mismatched if len(source) == 2 and source == model]
    if layout != "torch" or not stored:
        return ""
    return (
        f"{len(stored)} weight(s) ({', '.join(stored[:3])}{', ...' if len(stored) > 3 else ''}) fit as stored: they "
        "are (in, out) already, as Hugging Face's Conv1D keeps them. Pass as_is=[regex of their source names] "
        "(e.g. as_is=[r'\\.c_(attn|proj|fc)\\.weight$'] for GPT-2) to load them untransposed."
    )


def _rename_hint(unmatched: list[str], missing: list[str]) -> str:
    """A ``rename`` pair when one prefix, added or removed, explains most mismatched names."""
    counts: dict[tuple[str, str], int] = {}
    for name in unmatched:
        for target in missing:
            if name.startswith("opt_state/"):  # an optimizer's moments are never weights: no rename into them
                continue
            if name.endswith("/" + target) or name.endswith("." + target):
                key = (f"^{re.escape(name[: -len(target)])}", "")
            elif target.endswith("/" + name):
                key = ("^", target[: -len(name)])
            else:
                continue
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        return ""
    (pattern, replacement), count = max(counts.items(), key=lambda item: item[1])
    if count * 2 < min(len(unmatched), len(missing)):
        return ""
    return f"{count} names differ by a prefix: try rename=[({pattern!r}, {replacement!r})]"


def refuse(report: LoadReport, description: str) -> None:
    """``strict=True``: a ``ValueError`` naming every problem, before anything is read."""
    problems = report.problems()
    if not problems:
        return
    shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
    raise ValueError(
        f"The weights in {description} do not match the model ({len(problems)} problems); nothing was loaded:\n  "
        + "\n  ".join(shown)
        + (f"\n{report.hint}" if report.hint else "")
        + "\nMap names with rename=[(regex, replacement)], translate PyTorch names with layout='torch', leave new "
        "layers at their initial values with keep_initial=[regex], or pass strict=False to load what matches."
    )


def place(source: WeightSource, reads: Mapping[str, Read], targets: Mapping[str, Target]) -> dict[str, ArrayValue]:
    """Each read variable in its target's dtype and sharding; every device's shard read from
    the source by itself (a process reads only its own devices' shards); host NumPy arrays
    for targets without a sharding."""
    if isinstance(source, OrbaxSource):
        return _place_restored(source, reads, targets)
    placed: dict[str, ArrayValue] = {}
    for name, read in reads.items():
        target = targets[name]
        part = partial(_part, source, read, target.dtype)
        if target.sharding is None:
            placed[name] = part(tuple(slice(None) for _ in target.shape))
        else:
            placed[name] = jax.make_array_from_callback(target.shape, target.sharding, part)
    return placed


def _part(source: WeightSource, read: Read, dtype: np.dtype, index: Index) -> np.ndarray:
    """The part of a variable at ``index`` (in its own layout), read from its source entry."""
    if read.axes is None:
        return source.read(read.entry, index).astype(dtype, copy=False)
    source_index: list[slice | int] = [slice(None)] * len(read.axes)
    for axis, entry_axis in enumerate(read.axes):
        source_index[entry_axis] = index[axis] if axis < len(index) else slice(None)
    return np.transpose(source.read(read.entry, tuple(source_index)), read.axes).astype(dtype, copy=False)


def _place_restored(
    source: OrbaxSource, reads: Mapping[str, Read], targets: Mapping[str, Target]
) -> dict[str, ArrayValue]:
    """An orbax source restored in the shardings the targets imply for its own layout (each
    process reads its shards), then transposed and cast on the devices into the targets'."""
    shardings = {read.entry: _entry_sharding(targets[name].sharding, read.axes) for name, read in reads.items()}
    restored = source.place(shardings)
    placed: dict[str, ArrayValue] = {}
    for name, read in reads.items():
        target, value = targets[name], restored[read.entry]
        if target.sharding is None:
            host = np.asarray(value)
            placed[name] = (host if read.axes is None else np.transpose(host, read.axes)).astype(target.dtype)
            continue
        axes = read.axes
        convert = jax.jit(
            lambda a, axes=axes, dtype=target.dtype: (a if axes is None else jnp.transpose(a, axes)).astype(dtype),
            out_shardings=target.sharding,
        )
        placed[name] = convert(value)
    return placed


def _entry_sharding(
    sharding: jax.sharding.Sharding | None, axes: tuple[int, ...] | None
) -> jax.sharding.Sharding | None:
    """The sharding of a source entry whose transpose by ``axes`` has ``sharding``."""
    if sharding is None or axes is None:
        return sharding
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (len(axes) - len(sharding.spec))
        entry_spec: list[str | tuple[str, ...] | None] = [None] * len(axes)
        for axis, entry_axis in enumerate(axes):
            entry_spec[entry_axis] = spec[axis]
        return NamedSharding(sharding.mesh, PartitionSpec(*entry_spec))
    if sharding.is_fully_replicated:
        return sharding
    raise ValueError(f"Cannot transpose into a {type(sharding).__name__}; load into a NamedSharding.")
