#!/usr/bin/env bash
# The GPU checks in one run, under 8 minutes on one GPU, printed as one table of ratios:
# MFU of examples/lm.py's model against a hand-written jitted loop (bf16, fp32), step overhead
# on a small CNN, remat's memory saving, deterministic=True repeating bit for bit (and its
# cost), and export round trips. On a machine with one GPU and jax[cuda]:
#
#     bash benchmarks/gpu_suite.sh              # uses .venv/bin/python, or $PYTHON
#     bash benchmarks/gpu_suite.sh --small      # tiny sizes, also on CPU (a smoke test)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
if [[ " $* " != *" --small "* ]]; then
  "$PYTHON" -c 'import jax, sys; d = jax.devices()[0]; sys.exit(0 if d.platform == "gpu" else f"gpu_suite.sh wants a GPU; JAX sees {d.platform}: pass --small for the CPU smoke test")'
fi
export TRAINKIT_COMPILATION_CACHE=off  # every compile is a real one, and nothing from an earlier run
timeout 480 "$PYTHON" benchmarks/gpu_suite.py "$@"
