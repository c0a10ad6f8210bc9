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

# The light environment: CPU torch, transformers, speculators (no deps), ops deps, test tools. One build at a
# time: .ci/run starts one in the background beside its other setup steps, and `make test` reaches this
# target later; the second make waits on the lock, then finds .ready up to date.
ifneq ($(ENV_LOCKED),1)
$(VENV)/.ready: requirements/dev.txt pyproject.toml
	flock $(VENV).lock $(MAKE) --no-print-directory ENV_LOCKED=1 $@
else
$(VENV)/.ready: requirements/dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -r requirements/dev.txt
	$(PY) -m pip install -q --no-deps speculators==0.9.0
	$(PY) -m pip install -q --no-deps -e .
	touch $@
endif

env: $(VENV)/.ready ## build (or reuse) the light environment in .venv

demo: env ## tiny model end to end: prepare -> extract -> weights -> train -> verify
	$(PY) -m pipeline.demo --workdir $(DEMO_DIR) $(DEMO_ARGS)

test-fast: env ## tests that need only the light environment
	$(PY) -m pytest -m "not vllm and not gpu" $(PYTEST_ARGS)

# `make test` runs the suites in TEST_SUITES two at a time (CI has 2 cores), in their order, each one's output
# printed whole when it ends; then TEST_AFTER, one at a time. The light suite runs there as the chunks below,
# one pytest run each (together exactly what test-fast runs), so that beside the vLLM CPU suite (mk/vllm.mk
# puts it first: the longest) and after it both cores keep taking the next suite until none is left: longest
# first (docs/ci.md has the figures). Each chunk builds the session fixtures it uses again (tiny models, the
# warm CLI): seconds. The mk/ files add their suites.
LIGHT_CHUNKS := ops pipeline bench image train
TEST_SUITES := $(addprefix test-light-,$(LIGHT_CHUNKS)) test-light-rest
TEST_AFTER :=
# suites at once: one per core of CI's 2
TEST_JOBS ?= 2
# PyTorch threads per suite: the cores shared among the TEST_JOBS suites that run at once (an OMP_NUM_THREADS
# the caller set wins). Left at its default, each suite's OpenMP pool takes every core, and between two ops its
# idle threads spin on the cores the other suite needs: tests/train and tests/bench side by side took 443 s
# with 2 threads each and 326 s with 1 (docs/ci.md). Subprocesses (torchrun ranks, extraction workers, vLLM's
# processes) inherit it; vLLM's CPU workers still bind their threads to cores as they would.
TEST_THREADS ?= $(shell n=$$(( $$(nproc) / $(TEST_JOBS) )); echo $$(( n > 0 ? n : 1 )))
# the light environment: made before the suites start and not looked at again by them (-o), so that they
# start in TEST_SUITES' order (a suite waiting on a prerequisite gives its turn to the next one); the vLLM
# suites make theirs ready in their own recipes (mk/vllm.mk VLLM_READY), holding their lane meanwhile
TEST_PREPARE := env
.PHONY: $(addprefix test-light-,$(LIGHT_CHUNKS)) test-light-rest
$(addprefix test-light-,$(LIGHT_CHUNKS)): test-light-%: env
	$(PY) -m pytest -m "not vllm and not gpu" tests/$* $(PYTEST_ARGS)

test-light-rest: env
	$(PY) -m pytest -m "not vllm and not gpu" $(addprefix --ignore=tests/,$(LIGHT_CHUNKS)) $(PYTEST_ARGS)

test: env ## every test: the vLLM CPU suite and the light suite's chunks two at a time, then the ones that need them alone
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-$(TEST_THREADS)} $(MAKE) --no-print-directory -j$(TEST_JOBS) --keep-going --output-sync=target MAKE_TEST=1 \
	  $(addprefix -o ,$(TEST_PREPARE)) $(TEST_SUITES)
	$(if $(strip $(TEST_AFTER)),$(MAKE) --no-print-directory $(TEST_AFTER))

# the folders tests/test_lint.py checks (its PATHS)
LINT_PATHS := contract ops pipeline bench tests docker patches
.PHONY: lint lint-fix
lint: env ## ruff check and ruff format --check, as pyproject.toml configures them
	$(PY) -m ruff check $(LINT_PATHS) && $(PY) -m ruff format --check $(LINT_PATHS)

lint-fix: env ## ruff format, then ruff's safe fixes
	$(PY) -m ruff format $(LINT_PATHS) && $(PY) -m ruff check --fix $(LINT_PATHS)

-include mk/*.mk

# The order `make test` starts its suites in: two lanes, each taking the next suite when one ends, longest
# first so that both end together (the suites' seconds in docs/ci.md's latest run: engine 931, ops 713, stages
# 413, image 294, train 252, bench 210, pipeline 181, ops-vllm 65, rest 17). A suite of an mk/ file not named
# here runs last.
TEST_ORDER := test-vllm-engine test-light-ops test-vllm-stages test-light-image test-light-train \
  test-light-bench test-light-pipeline test-ops-vllm test-light-rest
TEST_SUITES := $(filter $(TEST_SUITES),$(TEST_ORDER)) $(filter-out $(TEST_ORDER),$(TEST_SUITES))
