#!/usr/bin/env bash
# Image area prerequisites for `make test` (tests/image): debootstrap, the Debian stand-in for the CUDA base
# (docker/build-ci-base.sh, cached under /var/cache/eagle-ops-image), and ./wheelhouse filled with the
# CI lock's wheels (requirements/image-ci.lock, ~0.8 GB; pip's cache makes a re-run quick; its CPU torch
# is not on PyPI: pip finds it where this machine's pip configuration points, on local disk). The tests
# build the image from these; they fail, not skip, when something here is missing. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! command -v debootstrap >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends debootstrap >/dev/null
fi
docker/build-ci-base.sh eagle-ops-image-ci-base:bookworm-4
docker/wheelhouse.sh requirements/image-ci.lock wheelhouse 3.11 36
