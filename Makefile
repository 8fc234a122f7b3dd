# megatron-rails: `make demo` (main job) and `make test` (the test suite) each create or refresh
# the local venv first. torch==2.13.0 is installed before anything else so the local CPU build is used.
#
# Megatron-Core versions: the default pin is 0.16.1 (Python 3.11). Newer releases declare Python 3.12
# but run here; `make test MCORE_VERSION=0.19.2 VENV=.venv-mcore019` resolves everything against
# 0.16.1 first, then swaps in the newer megatron-core (and the triton wheel its MoE package imports).
PYTHON ?= python3
VENV ?= .venv
BASE_MCORE := 0.16.1
MCORE_VERSION ?= $(BASE_MCORE)
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
STAMP := $(VENV)/.installed-$(MCORE_VERSION)
PYTEST_ARGS ?=

.PHONY: venv demo test bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py megatron_rails/core/planners/_ultraep_c.c megatron_rails/core/planners/_fsep_c.c \
          megatron_rails/core/planners/_flow_c.c megatron_rails/core/_buffers.h \
          megatron_rails/core/_route_c.c megatron_rails/sim/_dedup_c.c Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q "megatron-core==$(BASE_MCORE)" -e ".[dev]"
ifneq ($(MCORE_VERSION),$(BASE_MCORE))
	$(PIP) install -q --ignore-requires-python --no-deps "megatron-core==$(MCORE_VERSION)" triton
endif
	rm -f $(VENV)/.installed-* && touch $@

demo: venv
	$(BIN)/megatron-rails demo

test: venv
	$(BIN)/python -m pytest -q -n 2 $(PYTEST_ARGS)

bench: venv
	$(BIN)/megatron-rails bench planners --out bench/planners.json
	$(BIN)/megatron-rails bench step --out bench/step.json
	$(BIN)/megatron-rails bench dispatcher --out bench/dispatcher.json
	$(BIN)/megatron-rails bench rails --out bench/rails.json

clean:
	rm -rf $(VENV) .venv-mcore* .pytest_cache .hypothesis
