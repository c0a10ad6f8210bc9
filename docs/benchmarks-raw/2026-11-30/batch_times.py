# Scratch script behind 0902-batch-times.log (run after 0855 reused its /dev/shm/sb: for m in LAZY EAGER LAZY; do CUDA_MODULE_LOADING=$m python batch_times.py /dev/shm/sb 60; done).
"""per-batch device time of the hf loop from a fresh process, first batches vs steady."""
import json, os, sys, time
from pathlib import Path
t_start = time.perf_counter()
import torch
from pipeline import formats
from pipeline.backends.base import BackendOptions
from pipeline.backends.hf import HFBackend
from pipeline.extract import plan_batches
from pipeline.modeldir import read_model_dir
root = Path(sys.argv[1]); nb = int(sys.argv[2]); stride = int(sys.argv[3]) if len(sys.argv) > 3 else 1
torch.set_num_threads(16)
model = read_model_dir(root / "model")
samples, meta = formats.read_prepared(root / "prepared")
layer_ids = (2, 8, 13, 15)
be = HFBackend(BackendOptions(model=model, layer_ids=layer_ids, device="auto", dtype="auto", seq_length=meta.seq_length,
                              tensor_parallel_size=None, max_batch_tokens=32768, trust_remote_code=False))
t_loaded = time.perf_counter()
plan = plan_batches(samples.lengths(), 32768, 64)[::stride][:nb]
toks = []
pending = []
for b in plan:
    c = be.capture_async([samples.ids(i).tolist() for i in b.indices])
    toks.append(sum(samples.length(i) for i in b.indices))
    pending.append(c)
    if len(pending) > 2:
        pending.pop(0).ready()
torch.cuda.synchronize()
pairs = be.clock._pending
ms = [a.elapsed_time(e) for a, e in pairs]
us = [m * 1e3 / t for m, t in zip(ms, toks)]
steady = sorted(us[len(us) // 2:])[len(us[len(us) // 2:]) // 2]
print(json.dumps({"mode": os.environ.get("CUDA_MODULE_LOADING", "default"), "load_s": round(t_loaded - t_start, 2),
                  "first_us_per_tok": [round(x, 2) for x in us[:12]], "steady_median_us_per_tok": round(steady, 3),
                  "excess_ms_first_10": round(sum((u - steady) * t / 1e3 for u, t in zip(us[:10], toks[:10])), 1),
                  "excess_ms_all": round(sum((u - steady) * t / 1e3 for u, t in zip(us, toks)), 1),
                  "batches": len(us), "tokens": sum(toks)}), flush=True)
