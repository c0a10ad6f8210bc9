#!/usr/bin/env bash
# Docker engine for the tests: install docker.io if dockerd is missing, start dockerd in the background
# (logs in /var/log/dockerd.log) unless an engine already answers, and wait until `docker info` works.
# Idempotent and shared: several areas' tests use this engine, so a running one is never restarted.
set -euo pipefail

if docker info >/dev/null 2>&1; then
  echo "dockerd: already running"
  exit 0
fi

if ! command -v dockerd >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  # another setup step may hold the dpkg lock: wait for it rather than fail
  apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends docker.io >/dev/null
fi

# A dockerd may be starting right now (started by someone else): give it a moment before starting ours.
if pgrep -x dockerd >/dev/null 2>&1; then
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && { echo "dockerd: came up (started elsewhere)"; exit 0; }
    sleep 1
  done
  echo "dockerd: a dockerd process exists but does not answer; see /var/log/dockerd.log" >&2
  exit 1
fi

mkdir -p /var/log
# An engine that died uncleanly leaves containerd's pid file behind; once that pid is reused by another
# process, dockerd waits for a containerd that is not there and gives up after a minute. No dockerd runs
# at this point, so a pid file that does not name a live containerd is stale.
pidfile=/var/run/docker/containerd/containerd.pid
if [[ -f $pidfile ]] && [[ "$(cat "/proc/$(cat "$pidfile")/comm" 2>/dev/null)" != containerd ]]; then
  rm -f "$pidfile"
fi
# setsid: the engine must outlive this script and not share its process group
setsid dockerd >>/var/log/dockerd.log 2>&1 < /dev/null &
for _ in $(seq 1 60); do
  if docker info >/dev/null 2>&1; then
    echo "dockerd: started (pid $(pgrep -xo dockerd))"
    exit 0
  fi
  sleep 1
done
echo "dockerd: did not answer within 60 s; see /var/log/dockerd.log" >&2
tail -n 20 /var/log/dockerd.log >&2 || true
exit 1
