#!/usr/bin/env bash
# issue #21 on the H200 (not yet run: no device time on 2026-12-02). From the repository root, with runs/base =
# `git archive 2b2e071 pipeline contract` unpacked and runs/wheels as in ../2026-12-01/item5.sh; carry runs/base, runs/wheels:
# whole-process extract (GPU facts) vs the 2b2e071 tree (CPU facts) vs the naive script
set -u
if [ ! -d /tmp/site/speculators ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site runs/wheels/*.whl || exit 3
fi
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout ${2:-560} python3 -m bench.e2e_bench --shapes ${1:-llama-1b,llama-8b} --samples ${3:-1024,256} --workdir /tmp/e2e \
  --baseline runs/base --json-out $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "e2e rc=$?"; grep -v '^ ' $OUT/e2e.log | tail -30
