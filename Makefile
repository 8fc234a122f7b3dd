# megatron-rails: `make demo` (main job) and `make test` (the test suite) each create or refresh
# the local venv first. torch==2.13.0 is installed before anything else so the local CPU build is used.
#
# Megatron-Core: the default pin is 0.19.2, what `pip install megatron-core` brings. It declares
# Python >= 3.12 but runs on 3.11, so megatron-core alone is installed past that check (without its
# dependencies); the next install resolves its dependencies and this package's as usual, against the
# Python at hand. `make test MCORE_VERSION=0.16.1 VENV=.venv-mcore016 TRITON=` is CI's second pass.
# Triton (TRITON, a pip requirement; empty: none, and taken out of a reused venv): with it the Triton
# kernels' tests run under Triton's interpreter on CPU, and `make test` fails rather than skips them
# (REQUIRE, read by tests/optional.py; .ci/run adds slurm). Without it the torch paths serve.
PYTHON ?= python3
VENV ?= .venv
MCORE_VERSION ?= 0.19.2
TRITON ?= triton
REQUIRE ?= $(if $(TRITON),triton)
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
STAMP := $(VENV)/.installed-$(MCORE_VERSION)$(if $(TRITON),-triton)
PYTEST_ARGS ?=

.PHONY: venv demo test bench clean

venv: $(STAMP)

# the C extensions' sources and headers, all of them (a listed set missed a new shared header)
C_SOURCES := $(sort $(shell find megatron_rails -name '*.c' -o -name '*.h'))

$(STAMP): pyproject.toml setup.py $(C_SOURCES) Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --ignore-requires-python --no-deps "megatron-core==$(MCORE_VERSION)"
	$(PIP) install -q "megatron-core==$(MCORE_VERSION)" -e ".[dev]" $(TRITON)
	$(if $(TRITON),,$(PIP) uninstall -q -y triton)
	rm -f $(VENV)/.installed-* && touch $@

demo: venv
	$(BIN)/megatron-rails demo

test: venv
	MEGATRON_RAILS_REQUIRE="$(REQUIRE)" $(BIN)/python -m pytest -q -n 2 $(PYTEST_ARGS)

bench: venv
	$(BIN)/megatron-rails bench planners --out bench/planners.json
	for i in 1 2 3; do $(BIN)/megatron-rails bench step --out bench/step-runs/run$$i.json || exit 1; done
	for i in 1 2 3; do $(BIN)/megatron-rails bench step --record --workloads balanced,learned \
	  --out bench/step-runs/record-run$$i.json || exit 1; done
	$(BIN)/megatron-rails bench dispatcher --out bench/dispatcher.json
	$(BIN)/megatron-rails bench rails --out bench/rails.json

clean:
	rm -rf $(VENV) .venv-mcore* .pytest_cache .hypothesis
