"""A trained model exported for serving, with a symbolic batch axis: ``"jax"`` (the bytes of a
``jax.export.Exported``), ``"tf_saved_model"`` (jax2tf) or ``"onnx"`` (jax2onnx). Written by
:meth:`trainkit.Trainer.export`; :func:`load` reads the ``"jax"`` format back (see docs/export.md).

>>> import jax.numpy as jnp, numpy as np, os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "double.jax")
>>> write(path, lambda w, x: {"y": w * x["x"]}, 2.0, {"x": ((3,), "float32")}, "jax", verbose=False)
>>> load(path)({"x": np.ones((5, 3), np.float32)})["y"].shape
(5, 3)
"""

from trainkit.export.formats import FORMATS, check_format, computes_float32, export, resolve_format, write
from trainkit.export.jax_format import LoadedModel, load

__all__ = ["FORMATS", "LoadedModel", "check_format", "computes_float32", "export", "load", "resolve_format", "write"]
