"""Runs exported models the way a server would, in a process without trainkit or the models'
code: ``serve_export.py FORMAT PATH CASES.npz [PATH CASES.npz ...]`` prints, as JSON, the largest
difference from the expected outputs for each batch of inputs in each CASES file (``x:<i>:<leaf>``
inputs, ``y:<i>:<leaf>`` outputs, leaves in ``jax.tree.leaves`` order of the names the export
gave them; ``names`` the input and output names and the structure of the inputs)."""

import json
import sys

import numpy as np


def flat(outputs):
    if isinstance(outputs, dict):
        return [np.asarray(outputs[k]) for k in sorted(outputs)]
    if isinstance(outputs, (tuple, list)):
        return [np.asarray(o) for o in outputs]
    return [np.asarray(outputs)]


def runner(fmt, path, names):
    """``x -> flat outputs`` of the export at ``path``, loaded as a server of ``fmt`` loads it."""

    def flat_inputs(x):
        return [x[k] for k in names["inputs"]] if isinstance(x, dict) else list(x) if isinstance(x, tuple) else [x]

    if fmt == "jax":
        import jax

        exported = jax.export.deserialize(bytearray(open(path, "rb").read()))  # a plain jax.export serialization
        return lambda x: flat(exported.call(x)), flat_inputs
    if fmt == "tf_saved_model":
        import tensorflow as tf

        loaded = tf.saved_model.load(path)
        serving = loaded.signatures["serving_default"]

        def run(x):
            served = flat(tf.nest.map_structure(lambda t: t.numpy(), loaded.serve(x)))
            named = serving(**{n: tf.constant(v) for n, v in zip(names["inputs"], flat_inputs(x))})
            by_name = [named[n].numpy() for n in names["outputs"]]
            assert all(np.array_equal(a, b) for a, b in zip(served, by_name)), "serve and serving_default differ"
            return served

        run.loaded = loaded  # a restored function needs its object alive
        return run, flat_inputs
    import onnxruntime

    session = onnxruntime.InferenceSession(path)
    assert [i.name for i in session.get_inputs()] == names["inputs"], session.get_inputs()
    return lambda x: session.run(names["outputs"], dict(zip(names["inputs"], flat_inputs(x)))), flat_inputs


def differences(fmt, path, cases_path):
    cases = np.load(cases_path)
    names = json.loads(str(cases["names"]))
    run, flat_inputs = runner(fmt, path, names)
    found = {}
    for i in range(int(cases["count"])):
        leaves = [cases[f"x:{i}:{k}"] for k in range(len(names["inputs"]))]
        x = leaves[0] if names["structure"] == "array" else tuple(leaves)
        expected = [cases[f"y:{i}:{k}"] for k in range(len(names["outputs"]))]
        found[len(leaves[0])] = max(float(np.max(np.abs(g - e))) for g, e in zip(run(x), expected))
    return found


fmt, pairs = sys.argv[1], sys.argv[2:]
report = {path: differences(fmt, path, cases) for path, cases in zip(pairs[::2], pairs[1::2])}
print(json.dumps({"trainkit_imported": "trainkit" in sys.modules, "differences": report}))
