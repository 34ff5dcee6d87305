# Two commands on a fresh machine: `make demo` (the CPU demo of heterogeneous training) and
# `make test`. Both bootstrap .venv first (idempotent; see scripts/bootstrap_env.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: env lint check-gpu-build test test-all test-slow test-gpu demo clean

env:
	@VENV=$(VENV) bash scripts/bootstrap_env.sh

# ruff (ruff.toml); `make test` runs it first.
lint: env
	$(VENV)/bin/ruff check .

# Compile the GPU branches of csrc/ (USE_CUDA C++, nvcc kernels, hipcc where Debian's HIP installs)
# without a GPU, so errors in them fail here; see scripts/check_gpu_build.sh (~1 min here).
check-gpu-build: env
	@PY=$(PY) bash scripts/check_gpu_build.sh

# Default suite: everything except tests marked `slow` (long multi-process runs) or `gpu`.
test: env lint check-gpu-build
	$(PY) -m pytest -q -m "not slow and not gpu" $(PYTEST_ARGS)

# Only the long multi-process runs, and everything together.
test-slow: env
	$(PY) -m pytest -q -m "slow and not gpu" $(PYTEST_ARGS)

# Real GPUs (docs/gpu.md): NCCL/RCCL parity, bf16, a bridged island, memory. Skips without CUDA.
test-gpu: env
	$(PY) -m pytest -q -rs -m gpu tests/gpu $(PYTEST_ARGS)

test-all: env
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: env
	$(PY) pretrain_scripts/demo.py

clean:
	rm -rf runs build *.egg-info .pytest_cache
