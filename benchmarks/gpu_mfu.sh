#!/usr/bin/env bash
# MFU of the byte-level LM on one GPU: trainkit SingleDevice against a hand-written jitted loop
# with the same model (target: trainkit >= 0.97x). Run on a machine with one GPU and jax[cuda]:
#
#     bash benchmarks/gpu_mfu.sh            # uses .venv/bin/python, or $PYTHON
#
# The sizes make the step compute-bound on an H100-class GPU (about 60 M parameters, 16k tokens
# per step); pass other arguments through, e.g. bash benchmarks/gpu_mfu.sh --batch-size 16.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
"$PYTHON" - <<'EOF'
import jax
platform = jax.devices()[0].platform
if platform != "gpu":
    raise SystemExit(f"benchmarks/gpu_mfu.sh wants a GPU; JAX sees {platform} ({jax.devices()[0].device_kind}).")
EOF
for precision in bf16 fp32; do
  "$PYTHON" benchmarks/lm_mfu.py --layers 8 --d-model 768 --length 512 --batch-size 32 --steps 20 --repeats 5 \
    --precision "$precision" "$@"
done
