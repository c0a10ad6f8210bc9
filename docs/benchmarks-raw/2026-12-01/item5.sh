#!/usr/bin/env bash
# issue #17 item 5 on the H200: $1 = learned | compare-learned | compare-1b
set -u
if [ ! -d /tmp/site/speculators ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site runs/wheels/*.whl || exit 3
fi
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
case "$1" in
  learned)
    timeout 570 python3 bench/learned_bench.py --preset h200 --workdir /tmp/bl --keep-states --json $OUT/bench-learned.json 2>&1 | grep -v "it/s ]" > $OUT/bench-learned.log
    echo "bench rc=${PIPESTATUS[0]}"; tail -30 $OUT/bench-learned.log ;;
  compare-learned)
    ls /tmp/bl || exit 4
    timeout 575 python3 -m bench.train_compare --workdir /tmp/bl --epochs-short 1 --epochs-long 3 --max-len 8192 --lr 5e-4 --json $OUT/compare-learned.json > $OUT/compare-learned.log 2>&1
    echo "compare rc=$?"; cp /tmp/bl/cmp-*.log $OUT/ 2>/dev/null; grep -v "it/s\]\|s/it\]" $OUT/compare-learned.log | tail -25 ;;
  compare-1b)
    timeout 560 python3 -m bench.train_compare --workdir /tmp/w1 --build llama-1b --conversations 1500 --epochs-short 1 --epochs-long 2 --max-len 2048 --lr 3e-4 --speculators-env PYTHONPATH=$PWD/runs/gpu/dsshim:/tmp/site:$PWD --json $OUT/compare-1b.json > $OUT/compare-1b.log 2>&1
    echo "compare rc=$?"; cp /tmp/w1/cmp-*.log $OUT/ 2>/dev/null; grep -v "it/s\]\|s/it\]" $OUT/compare-1b.log | tail -25 ;;
esac
