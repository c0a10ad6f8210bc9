#!/usr/bin/env bash
# 2026-12-03 afternoon H200 runs (issue #21). $1 =
#   levers [limit s]             bench.hf_levers: packed eager, packed eager with fused RMSNorms, packed compiled,
#                                llama-1b and llama-8b, against fp32; then the compile's first batches with an
#                                empty inductor cache and again, in a fresh process, with the cache it left
#   e2e [limit s] [samples] [shapes]   bench.e2e_bench with the default flags, no baseline tree
#   load [shape]                 load_probe.py: the model built and saved once in /dev/shm, then the two ways
#                                of loading it in turns, each a fresh process
#   imports                      the hf backend's start-up imports, two fresh processes (-X importtime)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
case "$1" in
  levers)
    timeout ${2:-330} python3 -m bench.hf_levers --shapes llama-1b,llama-8b --samples 384,128 \
      --variants packed-32k,packed-fused-32k,packed-compiled-32k,packed-fused-32k,packed-32k --fp32-reference \
      --json-out $OUT/levers.json > $OUT/levers.log 2>&1
    echo "levers rc=$?"; grep -v '^ ' $OUT/levers.log | grep '^|' | tail -14
    rm -rf /tmp/ic; mkdir -p /tmp/ic
    for run in cold warm; do
      TORCHINDUCTOR_CACHE_DIR=/tmp/ic/inductor TRITON_CACHE_DIR=/tmp/ic/triton timeout 150 \
        python3 -m bench.hf_levers --shapes llama-1b --samples 48 --variants packed-compiled-32k \
        --json-out $OUT/cache-$run.json > $OUT/cache-$run.log 2>&1
      echo "cache $run rc=$? $(grep -o '"first_two_batches_seconds": [0-9.]*' $OUT/cache-$run.log)"
    done
    du -sh /tmp/ic/* ;;
  e2e)
    timeout ${2:-560} python3 -m bench.e2e_bench --shapes ${4:-llama-1b} --samples ${3:-3584} \
      --workdir /dev/shm/e2e --json-out $OUT/e2e.json > $OUT/e2e.log 2>&1
    echo "e2e rc=$?"; grep -v '^ ' $OUT/e2e.log | tail -24 ;;
  load)
    P=docs/benchmarks-raw/2026-12-03/load_probe.py; M=/dev/shm/lp-${2:-llama-8b}
    python3 $P build ${2:-llama-8b} $M 2>&1 | grep -v "it/s\]" ; du -sh $M
    for way in cpu-then-to device-map cpu-then-to device-map cpu-then-to device-map; do
      timeout 120 python3 $P load $way $M 2>&1 | grep '^{' || echo "$way failed"
    done ;;
  imports)  # the 12:50 call ran this inline, before it was a mode here
    for i in 1 2; do
      /usr/bin/time -f "wall %e s" python3 -X importtime -c \
        "import torch; from transformers import AutoModelForCausalLM; torch.cuda.init()" 2> $OUT/imp$i.txt
      tail -1 $OUT/imp$i.txt; sort -t'|' -k2 -n -r $OUT/imp$i.txt | head -25 | cut -c1-120
    done ;;
esac
