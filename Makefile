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
	$(PY) -m pytest -m "not vllm and not gpu" $(PYTEST_ARGS)

# `make test` runs the suites in TEST_SUITES side by side, each one's output printed whole when it ends: each
# keeps about one of CI's 2 cores busy (the light suite mostly waits on sshd, Docker and subprocesses; the
# vLLM CPU suite's load average is ~1.1). Then TEST_AFTER, one at a time: those share the Docker engine and
# test containers with the light suite's ops tests. The mk/ files add their suites.
TEST_SUITES := test-fast
TEST_AFTER :=
test: ## every test: the light suite and the vLLM CPU suite side by side, then the ones that need them alone
	$(MAKE) --no-print-directory -j2 --keep-going --output-sync=target $(TEST_SUITES)
	$(if $(strip $(TEST_AFTER)),$(MAKE) --no-print-directory $(TEST_AFTER))

# the folders tests/test_lint.py checks (its PATHS)
LINT_PATHS := contract ops pipeline bench tests docker patches
.PHONY: lint lint-fix
lint: env ## ruff check and ruff format --check, as pyproject.toml configures them
	$(PY) -m ruff check $(LINT_PATHS) && $(PY) -m ruff format --check $(LINT_PATHS)

lint-fix: env ## ruff format, then ruff's safe fixes
	$(PY) -m ruff format $(LINT_PATHS) && $(PY) -m ruff check --fix $(LINT_PATHS)

-include mk/*.mk
