#!/usr/bin/env bash
# 2026-12-03 H200 runs. $1 =
#   writers [conversations] [thread counts]   issue #21: extract --writer-threads side by side (llama-1b, one
#                                             prepared set in /dev/shm, one warm-up run, then the counts in turn
#                                             twice, each a fresh `pipeline extract` process, its output removed)
#   e2e [limit s] [samples] [shapes]          issue #21: bench.e2e_bench, no baseline tree
#   learned [limit s] [learned_bench args]    issue #17 item 4: bench/learned_bench.py --preset h200
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
df -h /dev/shm /tmp | tail -2
R=$PWD
case "$1" in
  writers)
    W=/dev/shm/wt; rm -rf $W; mkdir -p $W
    PYTHONPATH=. python3 - <<PY
from pathlib import Path
from bench.gpu_models import build_model, save_model
from bench.extract_bench import make_prepared
m = build_model("llama-1b", "cuda"); save_model(m, Path("$W/model")); v = m.config.vocab_size; del m
make_prepared(Path("$W/prep"), ${2:-512}, 2048, v)
PY
    n=0
    for t in 4 ${3:-4 16 8 4 16 8}; do
      s=$(date +%s.%N)
      PYTHONPATH=. python3 -m pipeline extract --prepared $W/prep --model $W/model --out $W/o --no-progress \
        --writer-threads $t --json-stats > $W/log 2>&1
      rc=$?; e=$(date +%s.%N)
      echo "threads=$t rc=$rc wall=$(python3 -c "print(round($e-$s,2))") $(grep 'tok/s' $W/log | tail -1)"
      python3 -c "import json,sys; d=json.loads([l for l in open('$W/log') if l.startswith('{')][-1]); print('   ', {k: d.get(k) for k in ('tokens_per_s','writer_wait_seconds','device_busy_seconds','seconds','bytes')})"
      cp $W/log $OUT/writers-$n-t$t.log; n=$((n+1))
      rm -rf $W/o
    done ;;
  e2e)
    export PYTHONPATH=.
    timeout ${2:-560} python3 -m bench.e2e_bench --shapes ${4:-llama-1b} --samples ${3:-3584} \
      --workdir /dev/shm/e2e --json-out $OUT/e2e.json > $OUT/e2e.log 2>&1
    echo "e2e rc=$?"; grep -v '^ ' $OUT/e2e.log | tail -40 ;;
  learned)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/site:.
    lim=${2:-570}; shift 2
    timeout $lim python3 bench/learned_bench.py --preset h200 --workdir /tmp/bl --json $OUT/learned.json "$@" 2>&1 \
      | grep -v "it/s\]\|s/it\]" > $OUT/learned.log
    echo "learned rc=${PIPESTATUS[0]}"; tail -40 $OUT/learned.log ;;
esac
