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

from trainkit import distributed
from trainkit.core.tree import PyTree
from trainkit.export import jax_format, onnx_format, tf_saved_model
from trainkit.export.signature import symbolic_inputs

#: Each format: what writes it, and the packages it needs with how to install them.
FORMATS: dict[str, tuple[Callable, dict[str, str]]] = {
    "jax": (jax_format.save, {}),
    "tf_saved_model": (tf_saved_model.save, {"tensorflow": "pip install tensorflow-cpu"}),
    "onnx": (
        onnx_format.save,
        {"jax2onnx": "pip install 'trainkit[export]'", "onnx": "pip install 'trainkit[export]'"},
    ),
}


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
    path: str | os.PathLike,
    function: Callable,
    variables: PyTree,
    spec: PyTree,
    format: str = "jax",
    *,
    verbose: bool = True,
    **options,
) -> None:
    """Exports ``function(variables, x)`` (pure; ``variables`` host arrays) for inputs of the
    per-example ``spec`` with a symbolic batch axis, in ``format``, to ``path`` (written by the
    main process; ``options`` go to the format: ``platforms=[...]`` for ``"jax"`` and
    ``"tf_saved_model"``, ``opset=`` for ``"onnx"``)."""
    check_format(format)
    if not distributed.is_main_process():
        return
    save = FORMATS[format][0]
    start = time.perf_counter()
    written = save(path, function, variables, symbolic_inputs(spec), **options)
    if verbose:
        details = ", ".join(f"{k} {v}" for k, v in written.items())
        print(f"Exported {format!r} to {path} in {time.perf_counter() - start:.2f} s ({details})")


def export(
    path: str | os.PathLike,
    inference: Callable[[], tuple[Callable, PyTree, PyTree]],
    format: str = "jax",
    *,
    verbose: bool = True,
    **options,
) -> None:
    """:meth:`trainkit.Trainer.export`: ``format`` checked first, then what ``inference()``
    returns (the function, its host variables, the per-example input spec) written by :func:`write`."""
    check_format(format)  # before anything is fetched or traced
    write(path, *inference(), format, verbose=verbose, **options)
