"""Runs an exported model the way a server would, in a process without trainkit or the model's
code: ``serve_export.py FORMAT PATH CASES.npz`` prints, as JSON, the largest difference from the
expected outputs for each batch of inputs in CASES (``x:<i>:<leaf>`` inputs, ``y:<i>:<leaf>``
outputs, leaves in ``jax.tree.leaves`` order of the names the export gave them)."""

import json
import sys

import numpy as np

fmt, path, cases_path = sys.argv[1:4]
cases = np.load(cases_path)
names = json.loads(str(cases["names"]))  # {"inputs": [...], "outputs": [...], "structure": "tuple" | "dict" | "array"}


def inputs(i):
    leaves = [cases[f"x:{i}:{k}"] for k in range(len(names["inputs"]))]
    if names["structure"] == "array":
        return leaves[0]
    if names["structure"] == "dict":
        return dict(zip(names["inputs"], leaves))
    return tuple(leaves)


def flat(outputs):
    if isinstance(outputs, dict):
        return [np.asarray(outputs[k]) for k in sorted(outputs)]
    if isinstance(outputs, (tuple, list)):
        return [np.asarray(o) for o in outputs]
    return [np.asarray(outputs)]


if fmt == "jax":
    import jax

    exported = jax.export.deserialize(bytearray(open(path, "rb").read()))
    run = lambda x: flat(exported.call(x))  # noqa: E731
elif fmt == "tf_saved_model":
    import tensorflow as tf

    loaded = tf.saved_model.load(path)
    serving = loaded.signatures["serving_default"]

    def run(x):
        served = flat(tf.nest.map_structure(lambda t: t.numpy(), loaded.serve(x)))
        named = serving(**{n: tf.constant(v) for n, v in zip(names["inputs"], flat_inputs(x))})
        by_name = [named[n].numpy() for n in names["outputs"]]
        assert all(np.array_equal(a, b) for a, b in zip(served, by_name)), "serve and serving_default differ"
        return served
else:
    import onnxruntime

    session = onnxruntime.InferenceSession(path)
    assert [i.name for i in session.get_inputs()] == names["inputs"], session.get_inputs()
    run = lambda x: session.run(names["outputs"], dict(zip(names["inputs"], flat_inputs(x))))  # noqa: E731


def flat_inputs(x):
    return [x[k] for k in names["inputs"]] if isinstance(x, dict) else list(x) if isinstance(x, tuple) else [x]


report = {"trainkit_imported": "trainkit" in sys.modules, "differences": {}}
for i in range(int(cases["count"])):
    x = inputs(i)
    got = run(x)
    expected = [cases[f"y:{i}:{k}"] for k in range(len(names["outputs"]))]
    rows = len(flat_inputs(x)[0])
    report["differences"][rows] = max(float(np.max(np.abs(g - e))) for g, e in zip(got, expected))
print(json.dumps(report))
