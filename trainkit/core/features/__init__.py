"""The train step's features, one module each, on the seam of :mod:`trainkit.core.step_feature`:
spike skipping (:mod:`.spike_skipping`), the global gradient norm (:mod:`.grad_norm`),
gradient statistics (:mod:`.gradient_statistics`) and the label check (:mod:`.label_check`).
A new feature is a module here and a line where the program lists the features a trainer's
settings ask for (:meth:`trainkit.program.steps.Steps.step_features`)."""
