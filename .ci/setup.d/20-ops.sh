#!/usr/bin/env bash
# Host setup for the ops tests (idempotent): sshd's privilege-separation dir, the cgroup-v1 freezer the
# "unkillable holder" test uses, and the cached Debian 12 base image the test images are built on.
set -euo pipefail
cd "$(dirname "$0")/../.."
test -x /usr/sbin/sshd || { echo "openssh-server missing (.ci/run installs it)" >&2; exit 1; }
command -v fuser >/dev/null || { echo "psmisc (fuser) missing" >&2; exit 1; }
mkdir -p /run/sshd
if [ ! -d /sys/fs/cgroup/freezer ]; then
  echo "warning: no cgroup-v1 freezer at /sys/fs/cgroup/freezer; the unkillable-holder test will fail" >&2
fi
docker info >/dev/null 2>&1 || bash .ci/setup.d/10-docker.sh
command -v debootstrap >/dev/null || apt-get -o DPkg::Lock::Timeout=300 install -y -qq debootstrap >/dev/null
bash tests/ops/images/build_base.sh
