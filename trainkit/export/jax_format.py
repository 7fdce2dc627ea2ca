"""The ``"jax"`` format: the bytes of ``jax.export.export(...).serialize()`` in one file, the
variables inside as constants, so that a process with neither trainkit nor the model's code runs
it: ``jax.export.deserialize(open(path, "rb").read()).call(x)``. The file carries its calling
convention version; :func:`load` checks it against the running JAX before anything runs.

>>> import numpy as np, os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "double.jax")
>>> from trainkit.export.signature import symbolic_inputs
>>> save(path, lambda w, x: w * x, 2.0, symbolic_inputs(((3,), "float32")))["calling_convention_version"] >= 9
True
>>> load(path)(np.ones((4, 3), np.float32)).shape
(4, 3)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

import jax

from trainkit.core.tree import PyTree


def save(
    path: str | os.PathLike,
    function: Callable,
    variables: PyTree,
    inputs: PyTree,
    platforms: Sequence[str] | None = None,
) -> dict:
    """Exports ``function(variables, x)`` for the symbolic ``inputs``, the variables inside as
    constants (for ``platforms``, default the current backend), into ``path``; returns what was
    written (bytes, calling convention, platforms)."""
    exported = jax.export.export(jax.jit(functools.partial(function, variables)), platforms=platforms)(inputs)
    data = exported.serialize()
    with open(path, "wb") as file:
        file.write(data)
    return {
        "bytes": len(data),
        "calling_convention_version": exported.calling_convention_version,
        "platforms": list(exported.platforms),
    }


class LoadedModel:
    """A ``"jax"`` export read back: call it with inputs of the structure it was exported with
    (any batch size); ``exported`` is the ``jax.export.Exported``."""

    def __init__(self, exported: jax.export.Exported, path: str):
        self.exported, self.path = exported, path

    def __call__(self, x: PyTree) -> PyTree:
        return self.exported.call(x)

    @property
    def input_shapes(self) -> PyTree:
        """The exported inputs (``jax.ShapeDtypeStruct``s, the batch axis symbolic)."""
        return jax.tree.unflatten(self.exported.in_tree, self.exported.in_avals)[0][0]

    def __repr__(self) -> str:
        return f"LoadedModel({self.path!r}, inputs={self.input_shapes}, platforms={self.exported.platforms})"


def load(path: str | os.PathLike) -> LoadedModel:
    """The ``"jax"`` export at ``path`` as a callable, refused with the reason when this JAX
    cannot run its calling convention or the file is no ``jax.export`` serialization."""
    with open(path, "rb") as file:
        data = bytearray(file.read())
    try:
        exported = jax.export.deserialize(data)
    except Exception as error:  # noqa: BLE001 - flatbuffers' own errors say nothing of the file
        raise ValueError(
            f"{path} is not a model exported with format='jax' (jax.export could not read its "
            f"{len(data)} bytes: {type(error).__name__}: {error}). Pass the file trainer.export(path) wrote."
        ) from error
    low, high = (
        jax.export.minimum_supported_calling_convention_version,
        jax.export.maximum_supported_calling_convention_version,
    )
    version = exported.calling_convention_version
    if not low <= version <= high:
        raise ValueError(
            f"{path} was exported with calling convention version {version}, but JAX {jax.__version__} runs "
            f"versions {low} to {high}: load it with a JAX that supports version {version}, or export it again."
        )
    platform = jax.default_backend()
    if platform not in exported.platforms and not (platform == "gpu" and {"cuda", "rocm"} & set(exported.platforms)):
        raise ValueError(
            f"{path} was exported for {list(exported.platforms)}, and this process runs on {platform}: export "
            f"it again with trainer.export(path, platforms=[..., {platform!r}])."
        )
    return LoadedModel(exported, str(path))
