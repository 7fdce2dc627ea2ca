"""The ``"onnx"`` format: an ONNX file that ``onnxruntime.InferenceSession`` runs, converted by
jax2onnx from the model's jaxpr (traced first by JAX with the symbolic batch axis, so only
jax2onnx's converters of JAX primitives are used: its Flax shortcuts, which patch ``flax.linen``
while it traces, fail on ``nn.avg_pool(x, (2, 2), strides=(2, 2))`` as the examples write it).
The route through a SavedModel and tf2onnx cannot work: jax2tf's native serialization leaves one
``XlaCallModule`` op, which tf2onnx does not convert. The variables become ONNX initializers.

>>> import os, tempfile, numpy as np, onnxruntime  # doctest: +SKIP
>>> from trainkit.export.signature import symbolic_inputs  # doctest: +SKIP
>>> path = os.path.join(tempfile.mkdtemp(), "double.onnx")  # doctest: +SKIP
>>> _ = save(path, lambda w, x: w * x, np.float32(2), symbolic_inputs(((3,), "float32")))  # doctest: +SKIP
>>> onnxruntime.InferenceSession(path).run(None, {"input": np.ones((4, 3), np.float32)})[0].shape  # doctest: +SKIP
(4, 3)
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os

import jax

from trainkit.core.local_path import LocalPath
from trainkit.core.tree import PyTree, TreeFunction
from trainkit.export.signature import leaf_names, output_names

#: Loggers that report jax2onnx's internals at WARNING on every conversion (optional plugins it
#: skips, value types it leaves unset): silenced while converting; their errors still show.
_CHATTY = ("jax2onnx", "onnx_ir")


@contextlib.contextmanager
def _quiet(names: tuple[str, ...]):
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def save(
    path: LocalPath, function: TreeFunction, variables: PyTree, inputs: PyTree, opset: int = 21
) -> dict[str, object]:
    """Writes the ONNX model of ``function(variables, x)`` for the symbolic ``inputs`` to ``path``."""
    import jax2onnx

    from trainkit.internals.jaxpr import as_function

    leaves, treedef = jax.tree.flatten(inputs)

    def flat(*xs):
        return jax.tree.leaves(function(variables, jax.tree.unflatten(treedef, list(xs))))

    traced = jax.make_jaxpr(flat)(*leaves)  # the variables become the jaxpr's constants
    in_names, out_names = leaf_names(inputs, "input"), output_names(function, variables, inputs)
    names = {"input_names": in_names, "output_names": out_names}
    try:
        with _quiet(_CHATTY):
            # "file": initializers past protobuf's 2 GB go to a sidecar path + ".data" (ONNX external data)
            jax2onnx.to_onnx(
                as_function(traced), leaves, opset=opset, return_mode="file", output_path=str(path), **names
            )
    except (AttributeError, ImportError) as error:  # jax2onnx reads JAX internals, which move between releases
        raise RuntimeError(
            f"jax2onnx {importlib.metadata.version('jax2onnx')} cannot convert under JAX {jax.__version__} "
            f"({type(error).__name__}: {error}): install a jax2onnx release made for this JAX, or export with "
            "format='jax' or 'tf_saved_model'."
        ) from error
    _bool_where_as_logic(str(path))
    size = sum(os.path.getsize(p) for p in (str(path), f"{path}.data") if os.path.exists(p))
    return {"bytes": size, "opset": opset, "inputs": in_names, "outputs": out_names}


def _bool_where_as_logic(path: str) -> None:
    """Rewrites each ``Where`` on booleans (``jnp.where`` / ``lax.select`` of masks: a causal
    mask), which onnxruntime does not implement, as ``Or(And(c, a), And(Not(c), b))``."""
    import onnx

    model = onnx.load(path, load_external_data=False)
    types = onnx.shape_inference.infer_shapes(model).graph.value_info
    is_bool = {v.name for v in types if v.type.tensor_type.elem_type == onnx.TensorProto.BOOL}
    nodes, changed = [], False
    for node in model.graph.node:
        if node.op_type != "Where" or node.output[0] not in is_bool:
            nodes.append(node)
            continue
        changed = True
        c, a, b = node.input
        out, tag = node.output[0], node.name or node.output[0]
        nodes += [
            onnx.helper.make_node("And", [c, a], [f"{tag}_if"]),
            onnx.helper.make_node("Not", [c], [f"{tag}_not"]),
            onnx.helper.make_node("And", [f"{tag}_not", b], [f"{tag}_else"]),
            onnx.helper.make_node("Or", [f"{tag}_if", f"{tag}_else"], [out]),
        ]
    if changed:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        onnx.save(model, path)
