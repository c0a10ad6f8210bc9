# Every target is a short alias of a command that also runs without make.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
DEMO_DIR ?= demo
# Every test run ends with its 25 slowest tests: CI's log then says where its minutes went.
PYTEST_ARGS ?= --durations=25

.PHONY: env demo test test-fast help
help:
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | sort

# The light environment: CPU torch, transformers, speculators (no deps), ops deps, test tools.
$(VENV)/.ready: requirements/dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -r requirements/dev.txt
	$(PY) -m pip install -q --no-deps speculators==0.9.0
	$(PY) -m pip install -q --no-deps -e .
	touch $@

env: $(VENV)/.ready ## build (or reuse) the light environment in .venv

demo: env ## tiny model end to end: prepare -> extract -> weights -> train -> verify
	$(PY) -m pipeline.demo --workdir $(DEMO_DIR) $(DEMO_ARGS)

test-fast: env ## tests that need only the light environment
	$(PY) -m pytest -m "not vllm" $(PYTEST_ARGS)

test: test-fast ## every test (also the vLLM CPU environment's)

# the folders tests/test_lint.py checks (its PATHS)
LINT_PATHS := contract ops pipeline bench tests docker patches
.PHONY: lint lint-fix
lint: env ## ruff check and ruff format --check, as pyproject.toml configures them
	$(PY) -m ruff check $(LINT_PATHS) && $(PY) -m ruff format --check $(LINT_PATHS)

lint-fix: env ## ruff format, then ruff's safe fixes
	$(PY) -m ruff format $(LINT_PATHS) && $(PY) -m ruff check --fix $(LINT_PATHS)

-include mk/*.mk
