#!/usr/bin/env bash
# Disk for one CI run: the one check of free space against the run's peak, and the reclaim of what earlier
# runs of this project left on a reused machine. `.ci/run` calls `reclaim` and then `check` before it
# installs anything, and `reclaim` again when it ends.
#   .ci/disk.sh check     exit 1 with one line (and where the disk went) when the checkout's filesystem
#                         has less free than the run needs at its peak
#   .ci/disk.sh reclaim   remove this project's stopped test containers, unused test and CI images, dangling
#                         images and the engine's build cache (CI's engine is its own; the image tests
#                         prune it too); never a running container, never an image in use, never a named
#                         image that is not ours (the base images stay: they save the debootstrap builds)
# The peak (measured on a fresh clone, 2026-12-02, `df` sampled every minute through `CI=true bash .ci/run`):
# +14.6 GB while the image tests run (.venv 1.7 GB, .venv-vllm 3.7 GB, wheelhouse 0.8 GB, the CI image,
# its variants and their build cache ~7 GB, the base images' rootfs tarballs and pytest's temp folders).
# The need below keeps a margin over it; an environment already built (.ready) lowers it by its size.
set -euo pipefail
cd "$(dirname "$0")/.."

NEED_GIB=${CI_DISK_NEED_GIB:-20}

free_gib() { echo $(( $(df -Pk "$1" | awk 'NR==2 {print $4}') / 1024 / 1024 )); }

where_it_went() {
  # the usual suspects, each bounded (no walk of the whole filesystem)
  local p
  for p in /var/lib/docker /var/cache/eagle-ops-image /var/cache/eagle-ops-test /tmp /root/.cache "$PWD"; do
    [ -e "$p" ] && du -xsh "$p" 2>/dev/null | tr '\t' ' '
  done | tr '\n' ';' | sed 's/;$//; s/;/; /g'
}

check() {
  local need=$NEED_GIB free
  [ -f .venv/.ready ] && need=$(( need - 2 ))
  [ -f .venv-vllm/.ready ] && need=$(( need - 4 ))
  free=$(free_gib .)
  if [ "$free" -lt "$need" ]; then
    echo "disk: ${free} GiB free in $(pwd), a CI run needs ~${need} GiB at its peak (the image tests): free disk" \
         "first (in use: $(where_it_went))" >&2
    exit 1
  fi
  echo "disk: ${free} GiB free in $(pwd), the run needs ~${need} GiB"
}

reclaim() {
  if ! docker info >/dev/null 2>&1; then
    echo "disk: no Docker engine answers, nothing of its to reclaim"
    return 0
  fi
  local before after ids
  # a test run under way (another checkout's, on a developer's machine) may be between two uses of a
  # labelled image: leave everything to it
  if pgrep -f 'python[0-9.]* -m pytest' >/dev/null 2>&1; then
    echo "disk: a pytest run is under way on this machine: nothing reclaimed"
    return 0
  fi
  before=$(free_gib .)
  # stopped containers of the tests (the ops tests label theirs; the image tests' compose projects and stage
  # containers are named eagle-ops*): a running one may be another checkout's test run and stays
  ids=$( { docker ps -aq --filter label=eagle-ops-test --filter status=exited --filter status=created \
             --filter status=dead
           docker ps -aq --filter name=eagle-ops --filter status=exited --filter status=created \
             --filter status=dead; } | sort -u)
  [ -n "$ids" ] && docker rm -f $ids >/dev/null  # shellcheck disable=SC2086 (ids are hex words)
  # unused images labelled by the tests, and the CI image's tags (eagle-ops:ci-*, eagle-ops-ship-test:*);
  # `docker rmi` without -f refuses an image a container uses, which is what we want
  docker image prune -af --filter label=eagle-ops-test >/dev/null
  docker images --format '{{.Repository}}:{{.Tag}}' \
    | grep -E '^(eagle-ops:ci-|eagle-ops-ship-test:)' | xargs -r docker rmi >/dev/null 2>&1 || true
  docker image prune -f >/dev/null  # dangling layers of earlier builds
  docker builder prune -af >/dev/null 2>&1 || true
  after=$(free_gib .)
  echo "disk: reclaimed $(( after - before )) GiB of earlier test runs' Docker leftovers (${after} GiB free)"
}

case "${1:-}" in
  check) check ;;
  reclaim) reclaim ;;
  *) echo "usage: $0 check|reclaim" >&2; exit 2 ;;
esac
