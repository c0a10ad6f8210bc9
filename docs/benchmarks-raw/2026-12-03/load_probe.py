"""Issue #21: the checkpoint load of extract's hf backend, two ways, each in fresh processes in turns.

    python docs/benchmarks-raw/2026-12-03/load_probe.py build SHAPE DIR     # a random model, saved
    python docs/benchmarks-raw/2026-12-03/load_probe.py load WAY DIR        # WAY: cpu-then-to | device-map

cpu-then-to is pipeline/backends/hf.py's load_causal_lm (from_pretrained to host memory, then .to(cuda));
device-map passes device_map={"": cuda:0} (needs accelerate). Prints one JSON line: seconds of the import,
of from_pretrained, of the move, and of the whole process so far.
"""

import json
import sys
import time

t0 = time.perf_counter()
cmd, arg, path = sys.argv[1:4]
if cmd == "build":
    from pathlib import Path

    sys.path.insert(0, ".")
    from bench.gpu_models import build_model, save_model

    save_model(build_model(arg, "cuda"), Path(path))
    sys.exit(0)
import torch
from transformers import AutoModelForCausalLM

torch.cuda.init()
t1 = time.perf_counter()
kw = {"device_map": {"": torch.device("cuda:0")}} if arg == "device-map" else {"low_cpu_mem_usage": True}
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kw)
t2 = time.perf_counter()
model = model.to("cuda").eval()
torch.cuda.synchronize()
t3 = time.perf_counter()
print(json.dumps({"way": arg, "import_s": round(t1 - t0, 2), "from_pretrained_s": round(t2 - t1, 2),
                  "move_s": round(t3 - t2, 2), "total_s": round(t3 - t0, 2),
                  "device": str(next(model.parameters()).device)}), flush=True)
