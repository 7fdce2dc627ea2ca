"""The ``"tf_saved_model"`` format: a SavedModel whose ``serve`` function (and
``serving_default`` signature, for TF Serving) runs the model, through ``jax2tf`` with native
serialization: the StableHLO JAX compiles, wrapped in TensorFlow's ``XlaCallModule``. The
variables are ``tf.Variable``s of the SavedModel, not constants of the graph (which TensorFlow
limits to 2 GB), as Keras 3's JAX backend exports them. jax2tf ships with JAX; orbax-export,
the other well-kept route, is built on it and adds a package and its own configuration.

>>> import os, tempfile, numpy as np, tensorflow as tf  # doctest: +SKIP
>>> from trainkit.export.signature import symbolic_inputs  # doctest: +SKIP
>>> path = os.path.join(tempfile.mkdtemp(), "double")  # doctest: +SKIP
>>> _ = save(path, lambda w, x: w * x, np.float32(2), symbolic_inputs(((3,), "float32")))  # doctest: +SKIP
>>> tf.saved_model.load(path).serve(np.ones((4, 3), np.float32)).shape  # doctest: +SKIP
TensorShape([4, 3])
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import numpy as np

from trainkit.core.local_path import LocalPath
from trainkit.core.tree import PyTree, TreeFunction
from trainkit.export.signature import leaf_names, output_names


def _tensor_spec(tf, leaf: jax.ShapeDtypeStruct):
    return tf.TensorSpec([None, *leaf.shape[1:]], tf.as_dtype(np.dtype(leaf.dtype)))


def save(
    path: LocalPath, function: TreeFunction, variables: PyTree, inputs: PyTree, platforms: Sequence[str] | None = None
) -> dict[str, object]:
    """Writes the SavedModel of ``function(variables, x)`` for the symbolic ``inputs`` to ``path``."""
    import tensorflow as tf
    from jax.experimental import jax2tf

    leaves, treedef = jax.tree.flatten(variables)
    module = tf.Module()
    module.weights = [tf.Variable(np.asarray(leaf), trainable=False) for leaf in leaves]
    polymorphic = jax.tree.map(lambda leaf: "(batch, ...)", inputs)
    converted = jax2tf.convert(
        lambda weights, x: function(jax.tree.unflatten(treedef, weights), x),
        polymorphic_shapes=[None, polymorphic],
        native_serialization_platforms=tuple(platforms) if platforms else None,
        with_gradient=False,
    )
    signature = jax.tree.map(lambda leaf: _tensor_spec(tf, leaf), inputs)
    module.serve = tf.function(lambda x: converted(module.weights, x), input_signature=[signature], autograph=False)

    in_names = leaf_names(inputs, "input")
    out_names = output_names(function, variables, inputs)
    flat_signature = [tf.TensorSpec(s.shape, s.dtype, name=n) for s, n in zip(jax.tree.leaves(signature), in_names)]

    def serving_default(*flat):  # TF Serving: named tensors in, a dict of named tensors out
        x = jax.tree.unflatten(jax.tree.structure(inputs), list(flat))
        return dict(zip(out_names, tf.nest.flatten(module.serve(x))))

    default = tf.function(serving_default, input_signature=flat_signature, autograph=False)
    tf.saved_model.save(module, str(path), signatures={"serving_default": default.get_concrete_function()})
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(str(path)) for f in files)
    return {"bytes": size, "inputs": in_names, "outputs": out_names}
