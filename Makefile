# Two commands on a fresh machine: `make demo` (the CPU demo of heterogeneous training) and
# `make test`. Both bootstrap .venv first (idempotent; see scripts/bootstrap_env.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: env lint test test-all test-slow demo clean

env:
	@VENV=$(VENV) bash scripts/bootstrap_env.sh

# ruff (ruff.toml); `make test` runs it first.
lint: env
	$(VENV)/bin/ruff check .

# Default suite: everything except tests marked `slow` (long multi-process runs).
test: env lint
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# Only the long multi-process runs, and everything together.
test-slow: env
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

test-all: env
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: env
	$(PY) pretrain_scripts/demo.py

clean:
	rm -rf runs build *.egg-info .pytest_cache
