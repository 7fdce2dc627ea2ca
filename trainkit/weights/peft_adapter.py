"""LoRA's adapters as a PEFT folder (``save_pretrained(..., adapter=True)``), which
``peft.PeftModel.from_pretrained(base, folder)`` loads onto the base model: each adapted kernel's
``A`` (``(in, rank)`` in trainkit, qwix's) as ``lora_A.weight`` ``(rank, in)`` and ``B``
(``(rank, out)``) as ``lora_B.weight`` ``(out, rank)``, under the base module's written name
(``base_model.model.<module>.lora_A.weight``); ``r`` and ``lora_alpha`` as trainkit's (both scale
by ``alpha / rank``); ``target_modules`` the adapted modules' full names, so no other module gets one.

>>> import numpy as np
>>> adapters = {"h_0/attn/kernel_lora_a": np.zeros((4, 2)), "h_0/attn/kernel_lora_b": np.zeros((2, 3))}
>>> arrays, modules = peft_arrays(adapters, lambda name, ndim: name.replace("/", ".").replace(".kernel", ".weight"))
>>> {name: a.shape for name, a in arrays.items()}, modules
({'base_model.model.h_0.attn.lora_A.weight': (2, 4), 'base_model.model.h_0.attn.lora_B.weight': (3, 2)}, ['h_0.attn'])
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import numpy as np

from trainkit.core.lora import ADAPTER_SUFFIXES, LoRA
from trainkit.weights.pretrained import Config

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def peft_arrays(
    adapters: Mapping[str, np.ndarray], written_name: Callable[[str, int], str]
) -> tuple[dict[str, np.ndarray], list[str]]:
    """``(PEFT's arrays by name, the adapted modules' written names)`` from trainkit's adapters by
    variable name; ``written_name(base kernel name, ndim)``: the name the merged folder writes the kernel
    under (``...weight``). Only a Dense kernel's (2-D) adapters have a PEFT form."""
    arrays: dict[str, np.ndarray] = {}
    modules: list[str] = []
    for name, a in adapters.items():
        if not name.endswith(ADAPTER_SUFFIXES[0]):
            continue
        kernel = name.removesuffix(ADAPTER_SUFFIXES[0])
        b = adapters[kernel + ADAPTER_SUFFIXES[1]]
        if a.ndim != 2 or b.ndim != 2:
            raise ValueError(
                f"The adapters of {kernel} are {a.shape} x {b.shape}: PEFT's LoRA holds a Linear layer's, two matrices."
                " Write the merged model instead (adapter=False)."
            )
        written = written_name(kernel, 2)
        module = written.removesuffix(".weight")
        if module == written:
            raise ValueError(
                f"The kernel {kernel} is written as {written!r}, not as a module's '.weight': PEFT names an adapter by "
                "its module. Give rename pairs that write Hugging Face's names (docs/finetuning.md)."
            )
        arrays[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(np.asarray(a).T)
        arrays[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(np.asarray(b).T)
        modules.append(module)
    if not modules:
        raise ValueError("adapter=True, but the model has no LoRA adapters: Trainer(lora=tk.LoRA(...)) trains them.")
    return arrays, sorted(modules)


def check_base(loaded_path: str | None, base: str | None) -> None:
    """Refuses adapters PEFT would add to other weights than they were trained on: the trainer's base
    never loaded (a random base), or loaded from another place than ``config=``'s base folder.

    >>> check_base(None, None)
    Traceback (most recent call last):
    ValueError: save_pretrained(adapter=True) writes LoRA's adapters alone, ...
    """
    fix = "Load the base the adapters train on first (tk.weights.load(base, into=trainer)), or write the merged model"
    if loaded_path is None:
        raise ValueError(
            "save_pretrained(adapter=True) writes LoRA's adapters alone, which PEFT adds to the published base's "
            "weights; this trainer's base was never loaded, so its adapters were trained on other weights and "
            f"PEFT's model would compute something else without a word. {fix} (adapter=False). Nothing was written."
        )
    if base is not None:
        loaded, named = os.path.realpath(loaded_path), os.path.realpath(base)
        if loaded != named and not loaded.startswith(named.rstrip(os.sep) + os.sep):
            raise ValueError(
                f"The adapters were trained on the base loaded from {loaded_path!r}, but config= names {base!r}: "
                f"PEFT would add them to that base's weights. Pass config={loaded_path!r}'s folder, or {fix[0].lower()}"
                f"{fix[1:]} (adapter=False). Nothing was written."
            )


def check_shapes(
    arrays: Mapping[str, np.ndarray], modules: list[str], expected: Mapping[str, tuple[int, ...]], transposed: bool
) -> None:
    """Refuses adapters whose ``(in, out)`` differ from their base module's in ``expected`` (the
    config's architecture, ``(out, in)``; ``transposed``: GPT-2's ``Conv1D``, ``(in, out)``)."""
    for module in modules:
        shape = expected.get(f"{module}.weight")
        if shape is None or len(shape) != 2:
            continue
        fan_in, fan_out = (shape[0], shape[1]) if transposed else (shape[1], shape[0])
        a, b = arrays[f"base_model.model.{module}.lora_A.weight"], arrays[f"base_model.model.{module}.lora_B.weight"]
        if a.shape[1] != fan_in or b.shape[0] != fan_out:
            raise ValueError(
                f"The adapters of {module} map {a.shape[1]} inputs to {b.shape[0]} outputs, but the config's "
                f"{module} maps {fan_in} to {fan_out}: PEFT could not load them onto that base. Pass the config of "
                "the base the trainer was loaded from. Nothing was written."
            )


def peft_config(lora: LoRA, modules: list[str], config: Config, base: str | None, fan_in_fan_out: bool) -> Config:
    """PEFT's ``adapter_config.json`` for these adapters (``fan_in_fan_out``: the base stores its kernels
    ``(in, out)``, as GPT-2's ``Conv1D`` does)."""
    causal = any(str(name).endswith("ForCausalLM") for name in config["architectures"])
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM" if causal else None,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": fan_in_fan_out,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "base_model_name_or_path": base if base is not None else config.get("_name_or_path"),
    }
