"""What a Hugging Face architecture expects to read, from its config alone: the model built on
PyTorch's ``meta`` device (no memory, nothing computed) and the names and shapes its
``save_pretrained`` would write (each parameter once: a tied head is its embedding's; persistent
buffers too). :func:`check` compares them with what trainkit would write and refuses, naming each
difference, before anything is written. Without ``transformers`` nothing is checked.

>>> mismatches({"a": (2, 3), "b": (4,)}, {"a": (2, 4), "c": (1,)}, {"vocab_size": 2})
... # doctest: +NORMALIZE_WHITESPACE
['missing (the architecture has it, the weights do not): c (1,)',
 'unexpected (the weights have it, the architecture does not): b (4,)',
 'a: written (2, 3), the architecture expects (2, 4)']
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

from trainkit.core.tree import Shape
from trainkit.weights.pretrained import Config


def expected_shapes(config: Config) -> dict[str, Shape] | None:
    """The names and shapes ``config``'s architecture (``architectures[0]``) writes, or ``None``
    without ``transformers`` (and torch) installed."""
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
        return None
    import torch
    import transformers

    name = config["architectures"][0]
    model_class = getattr(transformers, name, None)  # the lazy module imports the class on first use
    if model_class is None:
        raise ValueError(
            f"The config's architectures names {name!r}, which transformers {transformers.__version__} does not have: "
            "its readers could not build it. Nothing was written; name the class the base model's config names."
        )
    settings = {key: value for key, value in config.items() if key not in ("model_type", "architectures")}
    built = transformers.AutoConfig.for_model(config["model_type"], **settings)
    with torch.device("meta"):
        model = model_class(built)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}  # each tied parameter once
    persistent = model.state_dict(keep_vars=True)  # without the non-persistent buffers (rotary frequencies)
    shapes |= {name: tuple(b.shape) for name, b in model.named_buffers() if name in persistent}
    return shapes


def mismatches(written: Mapping[str, Shape], expected: Mapping[str, Shape], config: Config) -> list[str]:
    """Each difference between the names and shapes written and those expected, one line each."""
    missing = [f"{name} {expected[name]}" for name in expected if name not in written]
    extra = [f"{name} {written[name]}" for name in written if name not in expected]
    lines = [f"missing (the architecture has it, the weights do not): {', '.join(missing)}"] if missing else []
    lines += [f"unexpected (the weights have it, the architecture does not): {', '.join(extra)}"] if extra else []
    for name in written:
        if name in expected and tuple(written[name]) != tuple(expected[name]):
            line = f"{name}: written {tuple(written[name])}, the architecture expects {tuple(expected[name])}"
            vocab = config.get("vocab_size")
            if vocab in expected[name] and vocab not in written[name]:
                line += f" (the config's vocab_size is {vocab}: a padded vocabulary is cut back, or the config says it)"
            lines.append(line)
    return lines


def check(written: Mapping[str, Shape], config: Config) -> bool:
    """Refuses weights that ``config``'s architecture would not read whole (a ``ValueError`` naming each
    difference); ``False`` when nothing could be checked (no ``transformers``), ``True`` when checked."""
    expected = expected_shapes(config)
    if expected is None:
        return False
    lines = mismatches(written, expected, config)
    if lines:
        architecture = config["architectures"][0]
        raise ValueError(
            f"These weights are not what {architecture} ({config['model_type']}) reads; nothing was written:\n  "
            + "\n  ".join(lines)
            + "\nFix the rename pairs (or layout) that name the weights, or the config's sizes."
        )
    return True
