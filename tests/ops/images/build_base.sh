#!/usr/bin/env bash
# Build (once) the Debian 12 base image the ops tests use: debootstrap minbase + python3 + procps + psmisc,
# imported with `docker import`. No registry can be reached from the tests, so nothing is pulled.
# Cached twice: the image itself (skip when present) and the rootfs tarball under $OPS_BASE_CACHE.
set -euo pipefail
IMAGE="${1:-eagle-ops-test-base:bookworm}"
CACHE="${OPS_BASE_CACHE:-/var/cache/eagle-ops-test}"
if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "$IMAGE: present"
  exit 0
fi
mkdir -p "$CACHE"
TAR="$CACHE/bookworm-python3.tar"
if [ ! -s "$TAR" ]; then
  ROOT="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
  trap 'rm -rf "$ROOT"' EXIT
  debootstrap --variant=minbase --include=python3,procps,psmisc bookworm "$ROOT" http://deb.debian.org/debian >"$CACHE/debootstrap.log" 2>&1 \
    || { echo "debootstrap failed; see $CACHE/debootstrap.log" >&2; exit 1; }
  rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/*
  tar -C "$ROOT" -cf "$TAR.tmp" . && mv "$TAR.tmp" "$TAR"
fi
docker import --change 'CMD ["/bin/bash"]' "$TAR" "$IMAGE" >/dev/null
echo "$IMAGE: built"
