"""Pure helpers that give every leaf of a state a ``PartitionSpec`` (shared by FSDP and Hybrid).

A leaf is named by its path with ``/`` between keys (``params/Dense_0/kernel``,
``opt_state/0/mu/Dense_0/kernel``), so a rule written for a parameter also places the optimizer
moments of that parameter. Regex rules come first (``re.search`` on the name; two rules matching
one leaf is an error, as in Keras ``LayoutMap``); then the model's own annotations (Flax's
``nn.with_logical_partitioning`` names, given as ``{parameter path: names}``), mapped to mesh
axes by the logical rules ``(logical name, mesh axis)``, which a parameter's optimizer moments
follow too; otherwise the largest dimension divisible by the ``fsdp`` axis is sharded over it,
and leaves under ``min_shard_size`` elements stay replicated.

>>> import jax, jax.numpy as jnp
>>> tree = {"Dense_0": {"kernel": jax.ShapeDtypeStruct((16, 512), jnp.float32),
...                     "bias": jax.ShapeDtypeStruct((512,), jnp.float32)}}
>>> specs = partition_specs(tree, {"fsdp": 8}, fsdp_axis="fsdp", min_shard_size=1024)
>>> tuple(specs["Dense_0"]["kernel"]), tuple(specs["Dense_0"]["bias"])
((None, 'fsdp'), ())
>>> regex, logical = split_rules([("embed", "fsdp"), ("mlp", None)], ("fsdp",))
>>> tuple(logical_spec(("embed", "mlp"), logical, ("fsdp",), "params/Dense_0/kernel"))
('fsdp', None)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from trainkit.core.model import LogicalRule
from trainkit.core.offload import HOST_MEMORY, on_host
from trainkit.core.trace_context import Scoped
from trainkit.core.tree import PyTree, leaf_name

Rule = tuple[str, PartitionSpec]


def _is_mesh_axes(value: Any) -> bool:
    """A logical rule's right side: a mesh axis name, a tuple of them, or ``None``."""
    return (
        value is None or isinstance(value, str) or (isinstance(value, tuple) and all(isinstance(v, str) for v in value))
    )


def split_rules(
    rules: Sequence[Any], axis_names: Sequence[str]
) -> tuple[list[tuple[re.Pattern[str], PartitionSpec]], list[LogicalRule]]:
    """``rules`` checked and split into regex rules ``(regex, PartitionSpec)`` and logical
    rules ``(logical name, mesh axis | tuple of axes | None)`` (Flax's ``logical_axis_rules``,
    in order of precedence)."""
    regex, logical = [], []
    for rule in rules:
        if isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str) and _is_mesh_axes(rule[1]):
            name, axes = rule
            for axis in (axes,) if isinstance(axes, str) else axes or ():
                if axis not in axis_names:
                    raise ValueError(
                        f"The logical rule ({name!r}, {axes!r}) maps to the mesh axis {axis!r}, but this strategy's "
                        f"mesh has the axes {tuple(axis_names)}. Use one of those names, or None to replicate."
                    )
            logical.append((name, axes))
        else:
            regex.append(rule)
    return check_rules(regex, axis_names), logical


def logical_spec(
    names: Sequence[str | None], logical: Sequence[LogicalRule], axis_names: Sequence[str], parameter: str
) -> PartitionSpec:
    """Flax's ``logical_to_mesh_axes``: the rules in order, each giving its mesh axes to the
    dimension of its name when that dimension has none yet and this array does not use those
    axes already (a dimension whose rules were all blocked stays ``None``). A name no rule
    mentions may be a mesh axis itself (``nn.with_partitioning``); otherwise it is an error
    naming ``parameter``."""
    unassigned = object()
    result: list[Any] = [unassigned if isinstance(name, str) else None for name in names]
    used: set[str] = set()
    for rule_name, axes in logical:
        if rule_name not in names:
            continue
        position = list(names).index(rule_name)
        wanted = set((axes,) if isinstance(axes, str) else axes or ())
        if result[position] is unassigned and not wanted & used:
            result[position] = axes
            used |= wanted
    mentioned = {rule_name for rule_name, _ in logical}
    for position, name in enumerate(names):
        if result[position] is not unassigned:
            continue
        if name in mentioned:
            result[position] = None  # every rule for it was blocked by an axis already in use
        elif name is not None and name in axis_names and name not in used:
            result[position] = name
            used.add(name)
        else:
            raise ValueError(
                f"{parameter} is annotated {tuple(names)}, but no logical rule maps {name!r} (the rules map "
                f"{sorted(mentioned)}) and the mesh has no free axis of that name {tuple(axis_names)}. Add "
                f"({name!r}, <mesh axis>) to the strategy's rules, or ({name!r}, None) to replicate that dimension."
            )
    return PartitionSpec(*result)


def annotated_spec(
    name: str, shape: Sequence[int], annotations: Mapping[str, PartitionSpec]
) -> tuple[str, PartitionSpec] | None:
    """The annotated parameter ``name`` ends with (at a ``/``; the longest such path), for a
    parameter or one of its optimizer moments, and its spec; ``None`` when there is none."""
    best = None
    for path, spec in annotations.items():
        if (name == path or name.endswith("/" + path)) and (best is None or len(path) > len(best[0])):
            best = (path, spec)
    if best is None or len(best[1]) > len(shape):
        return None
    return best


def check_rules(rules: Sequence[Rule], axis_names: Sequence[str]) -> list[tuple[re.Pattern[str], PartitionSpec]]:
    """Validates ``[(regex, PartitionSpec), ...]`` against the mesh's axis names."""
    checked = []
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2):
            raise ValueError(
                f"Each rule is (regex, PartitionSpec) or (logical axis name, mesh axis); received {rule!r}. "
                "Examples: rules=[(r'Dense_0/kernel', PartitionSpec(None, 'model'))], rules=[('mlp', 'model')]."
            )
        pattern, spec = rule
        if not isinstance(spec, PartitionSpec):
            raise TypeError(
                f"The rule for {pattern!r} gives {spec!r}; pass a jax.sharding.PartitionSpec, "
                "e.g. PartitionSpec(None, 'model')."
            )
        for axis in _spec_axes(spec):
            if axis not in axis_names:
                raise ValueError(
                    f"The rule ({pattern!r}, {spec}) names the mesh axis {axis!r}, but this "
                    f"strategy's mesh has the axes {tuple(axis_names)}. Use one of those names."
                )
        try:
            checked.append((re.compile(pattern), spec))
        except re.error as error:
            raise ValueError(f"The rule pattern {pattern!r} is not a valid regex: {error}.") from None
    return checked


def _spec_axes(spec: PartitionSpec) -> list[str]:
    axes: list[str] = []
    for entry in spec:
        if entry is None:
            continue
        axes.extend(entry if isinstance(entry, tuple) else (entry,))
    return axes


def _entry_size(entry: str | tuple[str, ...] | None, axis_sizes: Mapping[str, int]) -> int:
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(axis_sizes[n] for n in names)


def _fits(spec: PartitionSpec, shape: Sequence[int], axis_sizes: Mapping[str, int]) -> str | None:
    """Why ``spec`` cannot place an array of ``shape``, or ``None`` when it can."""
    if len(spec) > len(shape):
        return f"it has {len(spec)} entries but the leaf has {len(shape)} dimensions"
    for dim, (size, entry) in enumerate(zip(shape, spec)):
        parts = _entry_size(entry, axis_sizes)
        if size % parts:
            return f"dimension {dim} has size {size}, which {parts} devices ({entry!r}) do not divide"
    return None


def default_spec(shape: Sequence[int], fsdp_axis: str | None, fsdp_size: int, min_shard_size: int) -> PartitionSpec:
    """The largest dimension divisible by the fsdp axis, sharded over it; else replicated."""
    if fsdp_axis is None or fsdp_size <= 1 or math.prod(shape) < min_shard_size:
        return PartitionSpec()
    candidates = [d for d, size in enumerate(shape) if size % fsdp_size == 0 and size >= fsdp_size]
    if not candidates:
        return PartitionSpec()
    dim = max(candidates, key=lambda d: (shape[d], -d))
    return PartitionSpec(*([None] * dim + [fsdp_axis]))


def leaf_spec(
    name: str,
    shape: Sequence[int],
    axis_sizes: Mapping[str, int],
    *,
    fsdp_axis: str | None,
    min_shard_size: int,
    rules: Sequence[tuple[re.Pattern[str], PartitionSpec]] = (),
    annotations: Mapping[str, PartitionSpec] | None = None,
) -> PartitionSpec:
    """The ``PartitionSpec`` of one leaf named ``name`` (see the module docstring);
    ``annotations``: ``{parameter path: PartitionSpec}`` from the model's annotations."""
    annotations = annotations or {}
    matches = [(p, s) for p, s in rules if p.search(name)]
    if len(matches) > 1:
        raise ValueError(
            f"{name} {tuple(shape)} matches {len(matches)} rules: "
            + ", ".join(f"({p.pattern!r}, {s})" for p, s in matches)
            + ". Each leaf may match one rule; make the patterns more specific."
        )
    default = default_spec(shape, fsdp_axis, axis_sizes.get(fsdp_axis, 1) if fsdp_axis else 1, min_shard_size)
    if matches:
        pattern, spec = matches[0]
        what = f"The rule ({pattern.pattern!r}, {spec})"
        change = "Change the rule's PartitionSpec, or the layer's size."
    else:
        found = annotated_spec(name, shape, annotations)
        if found is None:
            return default
        path, spec = found
        what = f"The annotation of {path}, placed as {spec} by the logical rules,"
        change = "Change the logical rules (or map that name to None), or the layer's size."
    problem = _fits(spec, shape, axis_sizes)
    if problem is None:
        return spec
    if name.startswith("params/") or name == "params":
        raise ValueError(f"{what} cannot place {name} of shape {tuple(shape)}: {problem}. {change}")
    return default  # e.g. a factored optimizer statistic of another shape than its parameter


def partition_specs(
    tree: PyTree,
    axis_sizes: Mapping[str, int],
    *,
    fsdp_axis: str | None,
    min_shard_size: int = 2**10,
    rules: Sequence[tuple[re.Pattern[str], PartitionSpec]] = (),
    annotations: Mapping[str, PartitionSpec] | None = None,
) -> PyTree:
    """A ``PartitionSpec`` for every array leaf of ``tree`` (arrays or ``ShapeDtypeStruct``s)."""

    def spec(path: tuple[Any, ...], leaf: Any) -> PartitionSpec:
        return leaf_spec(
            leaf_name(path),
            tuple(np.shape(leaf)),
            axis_sizes,
            fsdp_axis=fsdp_axis,
            min_shard_size=min_shard_size,
            rules=rules,
            annotations=annotations,
        )

    specs = jax.tree_util.tree_map_with_path(spec, tree)
    return _adapters_follow_kernels(tree, specs, rules)


#: LoRA adapters beside a kernel: ``<kernel>_lora_a`` (input dims, rank), ``<kernel>_lora_b`` (rank, output)
ADAPTER_A, ADAPTER_B = "_lora_a", "_lora_b"


def _adapters_follow_kernels(
    tree: PyTree, specs: PyTree, rules: Sequence[tuple[re.Pattern[str], PartitionSpec]]
) -> PyTree:
    """LoRA's adapters sharded as their kernel is: ``A`` (input dims, rank) takes the kernel's
    input dims' axes, ``B`` (rank, output) its output dim's, so ``x @ A @ B`` moves what ``x @ W``
    moves; a regex rule naming the adapter wins. The kernel may be stored quantised (its values
    under ``<kernel>/array/qvalue``)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if not any(leaf_name(path).endswith((ADAPTER_A, ADAPTER_B)) for path, _ in leaves):
        return specs
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    by_name = {leaf_name(path): (np.shape(leaf), spec) for (path, leaf), spec in zip(leaves, flat_specs)}
    followed = []
    for (path, leaf), spec in zip(leaves, flat_specs):
        name, shape = leaf_name(path), np.shape(leaf)
        kernel = next((by_name[k] for k in _kernel_names(name) if k in by_name), None)
        if kernel is None or any(pattern.search(name) for pattern, _ in rules):
            followed.append(spec)
            continue
        kernel_shape, kernel_spec = kernel
        axes = tuple(kernel_spec) + (None,) * (len(kernel_shape) - len(kernel_spec))
        if name.endswith(ADAPTER_A) and shape[:-1] == kernel_shape[:-1]:
            spec = PartitionSpec(*axes[:-1], None)
        elif name.endswith(ADAPTER_B) and shape[1:] == kernel_shape[-1:]:
            spec = PartitionSpec(None, axes[-1])
        followed.append(spec)
    return jax.tree.unflatten(jax.tree.structure(tree), followed)


def _kernel_names(name: str) -> list[str]:
    """Where an adapter's kernel may be: beside it (or its quantised values there), and for an
    optimizer moment of the adapter (``opt_state/.../mu/Dense_0/kernel_lora_a``) the kernel
    among the parameters (``params/Dense_0/kernel``): a frozen kernel has no moments."""
    suffix = next((s for s in (ADAPTER_A, ADAPTER_B) if name.endswith(s)), None)
    if suffix is None:
        return []
    base = name[: -len(suffix)]
    parts = base.split("/")
    places = [base] + ["/".join(("params", *parts[i:])) for i in range(1, len(parts))]
    return [k for place in places for k in (place, f"{place}/array/qvalue")]


def in_host_memory(shardings: PyTree, abstract: PyTree) -> PyTree:
    """``shardings`` with the leaves of ``abstract`` that :func:`~trainkit.core.offload.on_host`
    names placed in ``pinned_host`` memory (the same devices and ``PartitionSpec``).

    >>> import jax, numpy as np
    >>> one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> placed = in_host_memory([one, one], [np.zeros(3), np.int32(0)])
    >>> [s.memory_kind for s in placed][0], placed[1] is one
    ('pinned_host', True)
    """
    return jax.tree.map(lambda s, leaf: s.with_memory_kind(HOST_MEMORY) if on_host(leaf) else s, shardings, abstract)


def paths_in_host_memory(shardings: PyTree, paths: frozenset[str]) -> PyTree:
    """``shardings`` (of the parameters) with the leaves at ``paths`` (``"Dense_0/kernel"``)
    placed in ``pinned_host`` memory.

    >>> import jax
    >>> one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> placed = paths_in_host_memory({"a": one, "b": one}, frozenset({"b"}))
    >>> placed["a"].memory_kind, placed["b"].memory_kind
    ('device', 'pinned_host')
    """
    if not paths:
        return shardings
    return jax.tree_util.tree_map_with_path(
        lambda path, s: s.with_memory_kind(HOST_MEMORY) if leaf_name(path) in paths else s, shardings
    )


@dataclasses.dataclass(frozen=True)
class LogicalRules(Scoped):
    """A part of a step's trace context: ``mesh`` as the abstract mesh
    (``jax.sharding.use_abstract_mesh``: ``jax.set_mesh`` may not be entered under ``jit``) and
    Flax's logical axis ``rules`` active, so ``nn.with_logical_constraint`` on activations
    constrains them on this mesh."""

    mesh: Mesh
    rules: tuple[LogicalRule, ...]

    def entered(self) -> contextlib.AbstractContextManager[object]:
        stack = contextlib.ExitStack()
        stack.enter_context(jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh))
        stack.enter_context(nn.logical_axis_rules(self.rules))
        return stack
