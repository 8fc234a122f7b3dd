# megatron-rails: `make demo` (main job) and `make test` (the test suite) each create or refresh
# the local venv first. torch==2.13.0 is installed before anything else so the local CPU build is used.
PYTHON ?= python3
VENV ?= .venv
MCORE_VERSION ?= 0.16.1
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(MCORE_VERSION)
PYTEST_ARGS ?=

.PHONY: venv demo test bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q "megatron-core==$(MCORE_VERSION)" -e ".[dev]"
	rm -f $(VENV)/.installed-* && touch $@

demo: venv
	$(BIN)/megatron-rails demo

test: venv
	$(BIN)/python -m pytest -q -n 2 $(PYTEST_ARGS)

bench: venv
	$(BIN)/megatron-rails bench planners --out bench/planners.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
