"""``write``: one entry point for every export format, which checks the format and its optional
package before anything is traced, and reports what it wrote.

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "m.jax")
>>> write(path, lambda w, x: x + w, 1.0, ((2,), "float32"), "jax", verbose=False)
>>> os.path.getsize(path) > 0
True
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable

import numpy as np
from numpy.typing import DTypeLike

from trainkit import distributed
from trainkit.core.local_path import LocalPath, require_local
from trainkit.core.tree import PyTree, TreeFunction
from trainkit.distributed import atomic, filesystem
from trainkit.export import jax_format, onnx_format, tf_saved_model
from trainkit.export.signature import symbolic_inputs

#: Each format: what writes it, and the packages it needs with how to install them.
FORMATS: dict[str, tuple[Callable[..., dict[str, object]], dict[str, str]]] = {
    "jax": (jax_format.save, {}),
    "tf_saved_model": (tf_saved_model.save, {"tensorflow": "pip install tensorflow-cpu"}),
    "onnx": (
        onnx_format.save,
        {"jax2onnx": "pip install 'trainkit[export]'", "onnx": "pip install 'trainkit[export]'"},
    ),
}


def computes_float32(format: str, compute_dtype: DTypeLike, model_call: bool) -> bool:
    """Whether an export of a trainer computing in ``compute_dtype`` computes in float32:
    ``"onnx"`` of a bf16 or fp16 trainer does (ONNX Runtime's CPU provider has no bf16 Conv or
    Gemm and refuses such a file); refused when the trainer overrides ``apply`` (``model_call``
    false), whose own computation float32 cannot be put into.

    >>> computes_float32("onnx", "bfloat16", True), computes_float32("jax", "bfloat16", True)
    (True, False)
    """
    if format != "onnx" or np.dtype(compute_dtype) == np.float32:
        return False
    if not model_call:
        raise ValueError(
            f"format='onnx' exports in float32 (ONNX Runtime refuses {np.dtype(compute_dtype).name} Conv and Gemm "
            "on CPU), but this trainer overrides apply, which trainkit cannot run in float32 for you. Export "
            "format='jax', or copy the weights into a precision='fp32' trainer (fp32.init(x[:8]); "
            "fp32.set_weights(trainer.get_weights())) and export that."
        )
    return True


#: the suffixes that name a format (a SavedModel is a folder: no suffix)
SUFFIXES = {".jax": "jax", ".onnx": "onnx"}
#: what an export folder holds, by format: an existing folder of only these is an earlier export of
#: trainkit's, replaced whole; one holding anything else is refused (its files would be deleted)
FOLDER_ENTRIES = {"tf_saved_model": frozenset({"saved_model.pb", "variables", "assets", "fingerprint.pb"})}


def resolve_format(path: LocalPath, format: str | None) -> str:
    """The format of an export to ``path``: its suffix's (``.onnx``, ``.jax``), else ``format``
    (default ``"jax"``); a ``format`` the suffix contradicts is refused.

    >>> resolve_format("m.onnx", None), resolve_format("served", "tf_saved_model"), resolve_format("m", None)
    ('onnx', 'tf_saved_model', 'jax')
    """
    path = require_local(path, "the export's path")
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    named = SUFFIXES.get(suffix)
    if format is not None and named is not None and format != named:
        raise ValueError(
            f"export({os.fspath(path)!r}, format={format!r}): the file's suffix {suffix!r} names the {named!r} format. "
            f"Name the file for its format (e.g. {os.path.splitext(os.fspath(path))[0]}{_suffix_of(format)}) or pass "
            f"format={named!r}."
        )
    return format or named or "jax"


def _suffix_of(format: str) -> str:
    return next((suffix for suffix, name in SUFFIXES.items() if name == format), "/ (a folder)")


def check_format(format: str) -> None:
    """Refuses an unknown format, or one whose optional package is missing, naming the fix."""
    if format not in FORMATS:
        raise ValueError(f"Unknown export format {format!r}: pass one of {sorted(FORMATS)}.")
    for package, install in FORMATS[format][1].items():
        if importlib.util.find_spec(package) is None:
            raise ImportError(
                f"format={format!r} needs the package {package!r}, which is not installed: {install} "
                "(see docs/export.md)."
            )


def write(
    path: LocalPath,
    function: TreeFunction,
    variables: PyTree,
    spec: PyTree,
    format: str | None = None,
    *,
    verbose: bool = True,
    **options,
) -> None:
    """Exports ``function(variables, x)`` (pure; ``variables`` host arrays) for inputs of the
    per-example ``spec`` with a symbolic batch axis, in ``format``, to ``path`` (written by the
    main process; ``options`` go to the format: ``platforms=[...]`` for ``"jax"`` and
    ``"tf_saved_model"``, ``opset=`` for ``"onnx"``); ``format`` follows ``path``'s suffix
    (:func:`resolve_format`)."""
    format = resolve_format(path, format)
    check_format(format)
    if not distributed.is_main_process():
        return
    save = FORMATS[format][0]
    start = time.perf_counter()
    # written beside the target and renamed into place: a failed export leaves the previous one
    # whole (a missing parent folder is created)
    # moved (or a stale one removed) with it
    sidecars = (*atomic.SIDECARS, jax_format.SIDECAR) if format == "jax" else atomic.SIDECARS
    folder = f"export's {format!r} folder" if format in FOLDER_ENTRIES else None
    with atomic.staged(path, sidecars, folder_entries=FOLDER_ENTRIES.get(format, ()), folder=folder) as temporary:
        written = save(temporary, function, variables, symbolic_inputs(spec), **options)
    if verbose:
        details = ", ".join(f"{k} {v}" for k, v in written.items())
        print(f"Exported {format!r} to {path} in {time.perf_counter() - start:.2f} s ({details})")


def export(
    path: LocalPath,
    inference: Callable[[bool], tuple[TreeFunction, PyTree, PyTree]],
    format: str | None = None,
    compute_dtype: DTypeLike = np.float32,
    model_call: bool = True,
    *,
    verbose: bool = True,
    **options,
) -> None:
    """:meth:`trainkit.Trainer.export`: ``format`` checked first, then what ``inference(float32)``
    returns (the function, its host variables, the per-example input spec) written by :func:`write`;
    ``float32`` as :func:`computes_float32` decides for a trainer computing in ``compute_dtype``
    (``model_call``: its outputs are the model's own call, no ``apply`` override)."""
    format = resolve_format(path, format)  # a URL refused first
    check_format(format)  # before anything is fetched or traced
    float32 = computes_float32(format, compute_dtype, model_call)
    if format in FOLDER_ENTRIES:
        filesystem.require_folder(path, f"export's {format!r} folder")
    write(path, *inference(float32), format, verbose=verbose, **options)
