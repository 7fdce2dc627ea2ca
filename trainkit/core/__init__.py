"""Core: pure JAX and NumPy with no devices, files, threads or Trainer: the state, the pure
steps, precision, remat, model adapters, optimizers, metric totals and tree helpers (imports
nothing else of trainkit)."""
