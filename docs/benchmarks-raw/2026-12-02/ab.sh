#!/usr/bin/env bash
# A/B on one H200: pipeline extract from this tree (GPU facts) vs runs/base (2b2e071, CPU facts), llama-1b,
# alternating after one warm-up run, each on the same prepared set in /dev/shm, its output removed after it
set -u
export PYTHONUNBUFFERED=1
R=$PWD W=/dev/shm/ab; rm -rf $W; mkdir -p $W
PYTHONPATH=. python3 - <<PY
from pathlib import Path
from bench.gpu_models import build_model, save_model
from bench.extract_bench import make_prepared
m = build_model("llama-1b", "cuda"); save_model(m, Path("$W/model")); v = m.config.vocab_size; del m
make_prepared(Path("$W/prep"), ${1:-512}, 2048, v)
PY
n=0
for who in warm-ours base ours base ours base ours; do
  tree=$R; [ $who = base ] && tree=$R/runs/base
  s=$(date +%s.%N)
  (cd $tree && PYTHONPATH=$tree python3 -m pipeline extract --prepared $W/prep --model $W/model --out $W/o --no-progress > $W/log 2>&1)
  rc=$?; e=$(date +%s.%N)
  echo "$who rc=$rc wall=$(python3 -c "print(round($e-$s,2))") $(grep 'tok/s' $W/log | tail -1)"
  [ -n "${OUT:-}" ] && cp $W/log $OUT/ab-$n-$who.log; n=$((n+1))
  rm -rf $W/o
done
