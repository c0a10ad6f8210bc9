# Scratch probe behind 1137-load-probe.log (on nvidia-h200-x2, after 1135 left its model in /dev/shm/sb/model):
# for v in cpu_then_to device_map device_ctx base_device_map base_cpu_then_to cpu_then_to device_map device_ctx; do python3 load_probe.py /dev/shm/sb/model $v; done
# (device_map variants use the device image's accelerate 1.15.0; our image has no accelerate.)
"""where a fresh extract process's start-up goes on the GPU host: imports, CUDA init, model load variants."""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from transformers import AutoModelForCausalLM, AutoModel
t2 = time.perf_counter()
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t3 = time.perf_counter()
path, variant = sys.argv[1], sys.argv[2]
dt = torch.bfloat16
if variant == "cpu_then_to":
    m = AutoModelForCausalLM.from_pretrained(path, dtype=dt, low_cpu_mem_usage=True).to("cuda")
elif variant == "device_map":
    m = AutoModelForCausalLM.from_pretrained(path, dtype=dt, device_map="cuda")
elif variant == "device_ctx":
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_pretrained(path, dtype=dt)
elif variant == "base_device_map":
    m = AutoModel.from_pretrained(path, dtype=dt, device_map="cuda")
elif variant == "base_cpu_then_to":
    m = AutoModel.from_pretrained(path, dtype=dt, low_cpu_mem_usage=True).to("cuda")
torch.cuda.synchronize()
t4 = time.perf_counter()
devs = {str(p.device) for p in m.parameters()}
sd = m.state_dict()
k = [x for x in sd if "layers.3.mlp.down_proj" in x][0]
print(json.dumps({"variant": variant, "import_torch": round(t1 - t0, 2), "import_tf": round(t2 - t1, 2),
                  "cuda_init": round(t3 - t2, 2), "load": round(t4 - t3, 2), "devices": sorted(devs),
                  "check": float(sd[k].float().norm()), "params": sum(p.numel() for p in m.parameters())}), flush=True)
