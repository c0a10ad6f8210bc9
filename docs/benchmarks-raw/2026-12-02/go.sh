#!/usr/bin/env bash
# 2026-12-02 H200 runs: $1 = e2e [limit s] [samples] [shapes] [baseline tree | none] (issue #21) | compare-1b | learned-compare (issue #17 item 5)
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
df -h /dev/shm /tmp | tail -2
case "$1" in
  e2e)
    export PYTHONPATH=.
    timeout ${2:-560} python3 -m bench.e2e_bench --shapes ${4:-llama-1b,llama-8b} --samples ${3:-1024,256} \
      --workdir /dev/shm/e2e $([ "${5:-runs/base}" = none ] || echo --baseline ${5:-runs/base}) --json-out $OUT/e2e.json > $OUT/e2e.log 2>&1
    echo "e2e rc=$?"; grep -v '^ ' $OUT/e2e.log | tail -40 ;;
  compare-1b)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site runs/wheels/*.whl || exit 3
    export PYTHONPATH=/tmp/site:.
    python3 -c "import datasets, speculators, pyarrow; print('datasets', datasets.__version__, 'pyarrow', pyarrow.__version__)" || exit 4
    timeout ${2:-570} python3 -m bench.train_compare --workdir /tmp/w1 --build llama-1b --conversations 1500 \
      --epochs-short 1 --epochs-long ${3:-3} --max-len 2048 --lr 3e-4 \
      --speculators-arg=--loss-implementation --speculators-arg=eager \
      --speculators-env PYTHONPATH=$PWD/runs/gpu/dsshim:/tmp/site:$PWD --json $OUT/compare-1b.json > $OUT/compare-1b.log 2>&1
    echo "compare rc=$?"; cp /tmp/w1/cmp-*.log $OUT/ 2>/dev/null; grep -v "it/s\]\|s/it\]" $OUT/compare-1b.log | tail -30 ;;
  learned-compare)
    # a shorter learned recipe (60 s of target training, 1500 conversations) so that the target, the set and
    # both trainers at two epoch counts fit one device call
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site runs/wheels/*.whl || exit 3
    export PYTHONPATH=/tmp/site:.
    timeout 280 python3 bench/learned_bench.py --preset h200 --workdir /tmp/bl --keep-states --target-seconds 60 \
      --conversations 1500 --epochs 1 --json $OUT/learned.json 2>&1 | grep -v "it/s\]\|s/it\]" > $OUT/learned.log
    echo "learned rc=${PIPESTATUS[0]}"; grep "^\[" $OUT/learned.log | tail -12
    timeout ${2:-290} python3 -m bench.train_compare --workdir /tmp/bl --epochs-short 1 --epochs-long 2 --max-len 8192 \
      --lr 5e-4 --speculators-arg=--loss-implementation --speculators-arg=eager \
      --speculators-env PYTHONPATH=$PWD/runs/gpu/dsshim:/tmp/site:$PWD --json $OUT/compare-learned.json > $OUT/compare-learned.log 2>&1
    echo "compare rc=$?"; grep -v "it/s\]\|s/it\]" $OUT/compare-learned.log | tail -16 ;;
esac
