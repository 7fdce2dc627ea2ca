"""LoRA and QLoRA on any Flax module without editing it, through qwix (Google's JAX
quantization and LoRA library, which Tunix and MaxText use): ``qwix.LoraProvider`` intercepts
the module's ``dot_general`` / ``einsum`` / ``conv`` calls and adds ``<kernel>_lora_a`` and
``<kernel>_lora_b`` parameters beside each targeted kernel (B zero-initialised: step 0 computes
the base model); with ``quantize_base`` the targeted Dense kernels are stored quantised
(``nf4`` or ``int8``, channel-wise) and dequantised in the matmul.

>>> import flax.linen as nn, jax, numpy as np
>>> lora = LoRA(rank=2, alpha=4)
>>> model = lora.wrap(nn.Dense(3))
>>> params = model.init(jax.random.key(0), np.ones((1, 5)))["params"]
>>> sorted(params), params["kernel_lora_a"].shape, float(np.abs(params["kernel_lora_b"]).sum())
(['bias', 'kernel', 'kernel_lora_a', 'kernel_lora_b'], (5, 2), 0.0)
>>> merged = lora.merged(params)
>>> sorted(merged), merged["kernel"].shape
(['bias', 'kernel'], (5, 3))
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from trainkit.core.statistics import module_of
from trainkit.core.tree import ArrayValue, KeyPath, PyTree, Shape, leaf_name
from trainkit.internals.qwix import is_quantized, let_qwix_record_einsums_on_linen_modules

if TYPE_CHECKING:  # imported when a LoRA is made (qwix is optional until then)
    import flax.linen as nn
    import qwix
    from flax import nnx

ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")
QUANTIZED = (None, "nf4", "int8")


def is_adapter(name: str) -> bool:
    """Whether a parameter path names a LoRA adapter (``Dense_0/kernel_lora_a``)."""
    return name.endswith(ADAPTER_SUFFIXES)


@dataclasses.dataclass(frozen=True)
class LoRA:
    """``Trainer(lora=tk.LoRA(...))``: rank-``rank`` adapters, scaled by ``alpha / rank``, on the
    kernels of the modules whose path (``Block_0/Dense_1``) matches ``targets`` (``re.search``);
    the base frozen, and with ``quantize_base`` (``"nf4"`` or ``"int8"``, linen modules) its
    targeted Dense kernels stored quantised (QLoRA; convolutions keep float kernels: qwix
    quantises a conv only with its activations)."""

    rank: int = 8
    alpha: float = 16.0
    targets: str = ".*"
    quantize_base: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive integer; received {self.rank!r}.")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be positive; received {self.alpha!r}.")
        if self.quantize_base not in QUANTIZED:
            raise ValueError(f"quantize_base={self.quantize_base!r} is not one of {QUANTIZED}.")
        try:
            re.compile(self.targets)
        except (re.error, TypeError) as error:
            raise ValueError(
                f"LoRA(targets={self.targets!r}) is not a regular expression ({error}). targets is searched "
                "(re.search) in module paths such as 'Block_0/Dense_1', e.g. targets='Dense|attention'."
            ) from None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def provider(self) -> qwix.LoraProvider:
        """qwix's ``LoraProvider`` of these settings."""
        import qwix

        path = f".*(?:{self.targets}).*"  # qwix full-matches module paths; trainkit searches them
        options = {"module_path": path, "rank": self.rank, "alpha": float(self.alpha)}
        rules = [qwix.LoraRule(**options)]
        if self.quantize_base is not None:
            convs = qwix.LoraRule(op_names=("conv_general_dilated",), **options)
            rules = [convs, qwix.LoraRule(weight_qtype=self.quantize_base, **options)]
        return qwix.LoraProvider(rules)

    def wrap(self, model: nn.Module) -> nn.Module:
        """The linen module with qwix's LoRA interception (the module itself is not changed)."""
        import qwix

        let_qwix_record_einsums_on_linen_modules()
        wrapped: nn.Module = qwix.apply_lora_to_model(model, self.provider())
        return wrapped

    def wrap_nnx(self, model: nnx.Module, args: tuple[PyTree, ...], kwargs: dict[str, PyTree], seed: int) -> nnx.Module:
        """A copy of the NNX module with adapters, created by running it once on an input
        (qwix's way for NNX; the module given is not changed)."""
        import qwix
        from flax import nnx

        if self.quantize_base is not None:
            raise ValueError(
                "quantize_base (QLoRA) works on flax.linen modules; an NNX model trains float LoRA adapters "
                "(tk.LoRA(quantize_base=None))."
            )
        wrapped: nnx.Module = qwix.apply_lora_to_model(model, self.provider(), *args, rngs=nnx.Rngs(seed), **kwargs)
        return wrapped

    def merged(self, params: PyTree) -> PyTree:
        """The base model's parameters: each adapted kernel (dequantised if stored quantised)
        plus ``scale * A @ B``; the adapters removed."""
        return _merge(params, self.scale)


def _merge(node: PyTree, scale: float) -> PyTree:
    if not isinstance(node, Mapping):
        return node
    merged = {}
    for key, value in node.items():
        if isinstance(key, str) and is_adapter(key):
            continue
        base = dequantized(value)
        a, b = node.get(f"{key}_lora_a"), node.get(f"{key}_lora_b")
        if a is not None and b is not None:
            # a: the kernel's contracted axes x rank, b: rank x its other axes (a Dense kernel, or an
            # einsum's: attention's (embed, heads, kv) query and its (heads, kv, embed) output)
            if a.shape[:-1] + b.shape[1:] != base.shape:
                raise ValueError(f"Cannot fold adapters {a.shape} x {b.shape} into {key} {base.shape}.")
            delta = jnp.tensordot(jnp.asarray(a), jnp.asarray(b), axes=1) * scale
            merged[key] = (base + delta).astype(base.dtype)
        else:
            merged[key] = _merge(value, scale) if isinstance(value, Mapping) else base
    return merged


def idle_settings(lora: LoRA, params: PyTree) -> list[str]:
    """What of ``lora``'s settings does nothing on these parameters (one line each): adapters of
    a rank at least the kernel's smaller side (more parameters than a full fine-tune of it), a
    ``quantize_base`` that quantised no kernel."""
    notes = []
    named = {leaf_name(path): np.shape(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    wide = []
    for name, a in named.items():  # a: (in, rank), b: (rank, out)
        b = named.get(name.removesuffix(ADAPTER_SUFFIXES[0]) + ADAPTER_SUFFIXES[1])
        pair = name.endswith(ADAPTER_SUFFIXES[0]) and b is not None and len(a) == len(b) == 2
        if pair and b is not None and lora.rank >= min(a[0], b[1]):
            wide.append(module_of(name))
    if wide:
        notes.append(
            f"LoRA rank={lora.rank} is at least the smaller side of the kernels of {', '.join(wide[:4])}"
            f"{', ...' if len(wide) > 4 else ''}: their adapters hold more parameters than the kernels. Lower rank, "
            "or train those layers fully (trainable=...)."
        )
    if lora.quantize_base is not None and quantization(params) is None:
        notes.append(
            f"LoRA(quantize_base={lora.quantize_base!r}) quantised no kernel: no Dense kernel of this model matches "
            f"targets={lora.targets!r}, so the base stays in floating point."
        )
    return notes


def adapters_only(params: Mapping[str, PyTree]) -> dict[str, PyTree]:
    """The adapters of a parameter tree (nested dicts, as a checkpoint holds it), nothing else.

    >>> adapters_only({"d": {"kernel": 1, "kernel_lora_a": 2}, "e": {"bias": 3}})
    {'d': {'kernel_lora_a': 2}}
    """
    kept = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            inner = adapters_only(value)
            if inner:
                kept[key] = inner
        elif isinstance(key, str) and is_adapter(key):
            kept[key] = value
    return kept


def quantization(params: PyTree) -> str | None:
    """How a LoRA base is stored: ``"int8"`` or ``"nf4"`` (qwix's quantised kernels), ``None``
    for float kernels.

    >>> quantization({"d": {"kernel": 1.0}}) is None
    True
    """
    for leaf in jax.tree.leaves(params, is_leaf=is_quantized):
        if is_quantized(leaf):
            return str(leaf.array.qtype)
    return None


def with_adapters(params: Mapping[str, PyTree], adapters: Mapping[str, PyTree]) -> dict[str, PyTree]:
    """``params`` (nested dicts) with the adapters of ``adapters`` in place of its own."""
    merged = dict(params)
    for key, value in adapters.items():
        merged[key] = with_adapters(params[key], value) if isinstance(value, Mapping) else value
    return merged


def base_digest(params: PyTree) -> str:
    """A SHA-256 of the base parameters (every leaf but the adapters: names, dtypes, shapes,
    bytes), from host values: what an adapter checkpoint records of the weights it adapts."""
    digest = hashlib.sha256()
    for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(params), key=lambda item: leaf_name(item[0])):
        name = leaf_name(path)
        if any(part.endswith(ADAPTER_SUFFIXES) for part in name.split("/")):
            continue
        array = np.asarray(leaf)
        digest.update(f"{name}|{array.dtype}|{array.shape}|".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def dequantized(leaf: PyTree) -> PyTree:
    """A quantised parameter as a float array (qwix's ``dequantize``); anything else as is."""
    if not is_quantized(leaf):
        return leaf
    import qwix

    return qwix.dequantize(leaf.array)


def float_view(leaf: PyTree) -> tuple[Shape, np.dtype, jax.sharding.Sharding]:
    """``(shape, dtype, sharding)`` of a parameter as published weights hold it: a quantised
    kernel as the float array it stands for (its scale's dtype, its values' sharding)."""
    if is_quantized(leaf):
        values, scale = leaf.array.qvalue, leaf.array.scale
        return tuple(values.shape), np.dtype(scale.dtype), values.sharding
    return tuple(leaf.shape), np.dtype(leaf.dtype), leaf.sharding


def with_base(params: PyTree, arrays: Mapping[str, ArrayValue]) -> PyTree:
    """``params`` with the base leaves named in ``arrays`` replaced; a quantised kernel's float
    values quantised as the live one is (qwix's ``quantize_params``)."""

    def swap(path: KeyPath, leaf: PyTree) -> PyTree:
        value = arrays.get(leaf_name(path))
        if value is None:
            return leaf
        if not is_quantized(leaf):
            return value
        import qwix

        return qwix.quantize_params({"w": jnp.asarray(value)}, {"w": leaf})["w"]

    return jax.tree_util.tree_map_with_path(swap, params, is_leaf=is_quantized)
