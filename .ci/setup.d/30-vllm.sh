#!/usr/bin/env bash
# vLLM CPU test environment prerequisites (tests marked `vllm`, run by `make test-vllm`):
# a python3 that can create venvs (the disk it needs is part of .ci/disk.sh's check).
# The environment itself is built by `make env-vllm` (mk/vllm.mk), which `make test` reaches through
# test-vllm. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c "import ensurepip" >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends python3-venv >/dev/null
fi

echo "vllm: python3 venv ok"
