#!/usr/bin/env bash
# Build the image with the identity arguments the Dockerfile's labels and self-check need:
#   docker/build.sh IMAGE [docker build arguments...]
#   LOCK=requirements/image-ci.lock docker/build.sh eagle-ops:ci --build-arg OFFLINE=1 ...
# Computes GIT_REVISION, LOCK_SHA256 and PATCHES_SHA256 (docker/imageinfo.py) and passes them, with
# LOCK, as --build-arg; everything after IMAGE goes to `docker build` unchanged.
# The Dockerfile needs BuildKit: a docker with buildx (docker >= 23) builds with it by default; a
# docker 20.10 CLI (Debian 12's docker.io) needs DOCKER_BUILDKIT=1. Set DOCKER to force a CLI.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: $0 IMAGE[:TAG] [docker build arguments...]" >&2
  exit 2
fi
IMAGE="$1"; shift
LOCK="${LOCK:-requirements/image.lock}"
[ -r "$LOCK" ] || { echo "error: lock file $LOCK not found (LOCK=requirements/image.lock or image-ci.lock)" >&2; exit 2; }

pick_docker() {
  local cli
  if [ -n "${DOCKER:-}" ]; then echo "$DOCKER"; return; fi
  if docker buildx version >/dev/null 2>&1; then echo docker; return; fi
  # No buildx: a CLI older than 23 has BuildKit built in (DOCKER_BUILDKIT=1 below).
  for cli in docker /usr/bin/docker; do
    if command -v "$cli" >/dev/null 2>&1; then
      local major
      major="$("$cli" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)" || true
      if [ -n "$major" ] && [ "$major" -lt 23 ] 2>/dev/null; then echo "$cli"; return; fi
    fi
  done
  echo "error: no docker CLI that can use BuildKit: install the buildx plugin (docker-buildx)" >&2
  return 1
}
cli="$(pick_docker)"

identity=()
while IFS= read -r kv; do identity+=(--build-arg "$kv"); done \
  < <(python3 docker/imageinfo.py build-args --lock "$LOCK" --patches patches)
[ "${#identity[@]}" -eq 6 ] || { echo "error: docker/imageinfo.py gave no build arguments" >&2; exit 2; }

set -x
DOCKER_BUILDKIT=1 "$cli" build --progress=plain -f Dockerfile -t "$IMAGE" \
  --build-arg LOCK="$LOCK" "${identity[@]}" "$@" .
