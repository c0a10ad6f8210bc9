# Scratch probe behind 1143-warm-probe.log (on nvidia-h200: a llama-1b model and 512 prepared samples built by
# bench.extract_bench's helpers in /dev/shm/wp; then for m in full nocopy prewarm warmfwd full prewarm nocopy warmfwd;
# do python3 warm_probe.py /dev/shm/wp $m 30; done).
"""first-batch cost of the hf loop from a fresh process: what is it? (pinned host allocs, forward warm-up)"""
import json, os, sys, time
import torch
from pipeline import formats
from pipeline.backends.base import BackendOptions
from pipeline.backends.hf import HFBackend
from pipeline.extract import plan_batches
from pipeline.modeldir import read_model_dir
root, mode, nb = sys.argv[1], sys.argv[2], int(sys.argv[3])
from pathlib import Path
root = Path(root)
torch.set_num_threads(16)
model = read_model_dir(root / "model")
samples, meta = formats.read_prepared(root / "prepared")
be = HFBackend(BackendOptions(model=model, layer_ids=(2, 8, 13, 15), device="auto", dtype="auto", seq_length=meta.seq_length,
                              tensor_parallel_size=None, max_batch_tokens=32768, trust_remote_code=False))
plan = plan_batches(samples.lengths(), 32768, 64)[:nb]
H = model.hidden_size
t_pre = time.perf_counter()
if mode == "prewarm":  # pinned blocks of the first batches' sizes, allocated and freed: the host cache keeps them
    keep = [torch.empty((samples.length(i), H), dtype=torch.bfloat16, pin_memory=True) for b in plan[:4] for i in b.indices for _ in range(4)]
    del keep
if mode == "warmfwd":  # one untimed forward of the first batch
    be.forward_layers([samples.ids(i).tolist() for i in plan[0].indices]); torch.cuda.synchronize()
pre_s = time.perf_counter() - t_pre
toks, host_ms, pending = [], [], []
for b in plan:
    seqs = [samples.ids(i).tolist() for i in b.indices]
    h0 = time.perf_counter()
    if mode == "nocopy":
        be.clock.start(); be.forward_layers(seqs); be.clock.stop()
    else:
        pending.append(be.capture_async(seqs))
        if len(pending) > 2:
            pending.pop(0).ready()
    host_ms.append((time.perf_counter() - h0) * 1e3)
    toks.append(sum(len(s) for s in seqs))
torch.cuda.synchronize()
us = [a.elapsed_time(e) * 1e3 / t for (a, e), t in zip(be.clock._pending, toks)]
steady = sorted(us[len(us) // 2:])[len(us[len(us) // 2:]) // 2]
print(json.dumps({"mode": mode, "pre_s": round(pre_s, 2), "first_us_per_tok": [round(x, 1) for x in us[:8]],
                  "host_ms": [round(x) for x in host_ms[:8]], "steady": round(steady, 2),
                  "excess_ms_first_10": round(sum((u - steady) * t / 1e3 for u, t in zip(us[:10], toks[:10]))),
                  "padded": [b.padded_tokens for b in plan[:6]], "sizes": [len(b.indices) for b in plan[:6]]}), flush=True)
