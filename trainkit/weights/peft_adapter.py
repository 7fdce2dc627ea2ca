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
