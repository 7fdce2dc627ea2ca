"""The one place trainkit reaches past the public APIs of JAX, Flax and qwix: each internal is used
here once, behind a function or type named for what trainkit does with it, so a JAX release that
moves one changes one file (tested on the oldest and newest JAX the project supports: CI's Python
3.11 and 3.12 runs). It imports nothing of trainkit's; every other package may import it.

- :mod:`~trainkit.internals.jaxpr`: a traced program's equations (the pipeline's split forward
  pass, the host-offloaded update, the learning-rate probe, the ONNX export);
- :mod:`~trainkit.internals.rebinding`: a module attribute or a frozen module's field swapped for
  the length of a ``with`` block and always put back (the context axis's attention reach, frozen
  batch statistics, qwix's LoRA note on linen modules);
- :mod:`~trainkit.internals.runtime`: JAX's distributed client, backend and cluster detection,
  its compilation cache's entries and XLA's HLO cost analysis.
"""
