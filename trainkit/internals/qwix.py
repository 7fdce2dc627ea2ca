"""qwix's internals: its quantised-parameter node, and its one ``setattr`` on linen modules.

>>> import numpy as np
>>> is_quantized(np.zeros(3))
False
"""

from __future__ import annotations

import sys

#: the module of qwix's quantised-parameter node, ``WithAux``
_PTQ = "qwix._src.providers.ptq"


def is_quantized(leaf: object) -> bool:
    """Whether a parameter node is a qwix quantised array (its ``qvalue`` and ``scale`` inside).
    Without qwix imported (no LoRA in this process) nothing is: qwix is not imported for it."""
    ptq = sys.modules.get(_PTQ)
    return ptq is not None and isinstance(leaf, ptq.WithAux)


def let_qwix_record_einsums_on_linen_modules() -> None:
    """qwix 0.1.8's LoRA ``einsum`` (a kernel used through ``jnp.einsum``, as attention's
    ``(embed, heads, kv)`` kernels are) records its LoRA equation on the current module, for
    debugging, with ``setattr``, which a linen module refuses outside ``setup``
    (``SetAttributeFrozenModuleError``): every linen model with such a kernel failed. That one
    call, in that one qwix module, is given a ``setattr`` that writes the record as a plain
    attribute; everything else is Python's ``setattr``. Idempotent."""
    import flax.linen as linen
    from qwix._src.providers import lora as qwix_lora

    def setattr_recording(target: object, name: str, value: object) -> None:
        if isinstance(target, linen.Module) and name.endswith("_lora_einsum_str"):
            object.__setattr__(target, name, value)  # a debugging note, not a field of the module
        else:
            setattr(target, name, value)

    vars(qwix_lora).setdefault("setattr", setattr_recording)
