# Two entry points for a fresh machine with Python 3.11+ and make:
#   make example   sets up .venv and trains the digits CNN on 8 fake CPU devices
#   make test      sets up .venv and runs the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: example test test-tpu test-engines lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	# ml_dtypes 0.7 with numpy < 2.5 (all Python 3.11 has) spends 0.6 s registering its ufunc loops at
	# every `import jax`; 0.6 does not (docs/performance.md, "Import time"): the suite starts ~100 processes
	$(BIN)/python -m pip install --quiet -e ".[dev,examples,data,monitoring]" "ml_dtypes<0.7; python_version < '3.12'"
	# the "onnx" export's packages without jax2onnx's pin of orbax-checkpoint<0.11.37: the suite runs on the newest orbax
	$(BIN)/python -m pip install --quiet "onnx>=1.20" "onnx-ir>=0.2" "onnxruntime>=1.24" equinox dm-pix einops
	$(BIN)/python -m pip install --quiet --no-deps "jax2onnx>=0.17"
	touch $@

example: $(VENV)/.installed
	$(BIN)/python examples/digits_cnn.py --devices 8

test: $(VENV)/.installed
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -q tests --ignore=tests/engines

# The chip's own tests (tests/accelerator/, docs/tpu.md) in ONE process: a TPU admits one (no -n, and
# no subprocess opens it). Without tests/conftest.py's fake CPU devices; each test skips without an
# accelerator. On the TPU machine (no registry): `source .whl-tpu/install.sh && make test-tpu`.
TPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
test-tpu:
	$(TPU_PYTHON) -m pytest -q -s -p no:xdist --confcutdir=tests/accelerator tests/accelerator

# SLURM, Open MPI and Ray, run for real (docs/clusters.md): root, `apt-get install slurm-wlm openmpi-bin`
# and the ray extra; each engine skips with the reason where it is missing. .ci/run installs them.
test-engines: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e ".[ray]"
	$(BIN)/python -m pytest -q -s tests/engines

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/step_overhead.py
	$(BIN)/python benchmarks/memory.py
	$(BIN)/python benchmarks/prefetch.py
	$(BIN)/python benchmarks/startup.py
	$(BIN)/python benchmarks/steps_per_execution.py
	$(BIN)/python benchmarks/finders.py

clean:
	rm -rf $(VENV)
