#!/usr/bin/env bash
# vLLM CPU test environment prerequisites (tests marked `vllm`, run by `make test-vllm`):
# a python3 that can create venvs, and enough disk for .venv-vllm (~3.5 GB; pip keeps no cache in CI).
# The environment itself is built by `make env-vllm` (mk/vllm.mk), which `make test` reaches through
# test-vllm. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c "import ensurepip" >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends python3-venv >/dev/null
fi

need_gib=6
[ -f .venv-vllm/.ready ] && need_gib=1
free_gib=$(( $(df -Pk . | awk 'NR==2 {print $4}') / 1024 / 1024 ))
if [ "$free_gib" -lt "$need_gib" ]; then
  echo "vllm: ${free_gib} GiB free in $(pwd), the vLLM CPU environment needs ~${need_gib} GiB: free disk first" >&2
  exit 1
fi
echo "vllm: python3 venv ok, ${free_gib} GiB free"
