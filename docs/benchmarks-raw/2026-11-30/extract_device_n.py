# Scratch script behind 0551-extract-device-cuda0-vs-cuda1.log (run: python extract_device_n.py llama-1b cuda:0,cuda:1).
"""Scratch (not committed): extract with --device cuda:0 and cuda:1 must give the same states, on the GPU asked."""
import json, subprocess, sys, threading, time
from pathlib import Path
import torch
from bench.extract_bench import PRESETS, make_prepared
from pipeline.tiny import build_tiny_model
from pipeline import formats

root = Path("/dev/shm/dn"); subprocess.run(["rm", "-rf", str(root)]); root.mkdir()
overrides, _, seq, _ = PRESETS[sys.argv[1]]
DEVS = sys.argv[2].split(",")
model = build_tiny_model("llama", root / "model", **overrides)
make_prepared(root / "prepared", 96, seq, overrides.get("vocab_size", 1024))
seen, stop = set(), threading.Event()
def sample():
    while not stop.is_set():
        out = subprocess.run(["nvidia-smi" if DEVS[0] != "cpu" else "true", "--query-compute-apps=pid,gpu_bus_id,used_memory", "--format=csv,noheader"], capture_output=True, text=True).stdout
        for line in out.strip().splitlines():
            seen.add((tag, line.split(",")[1].strip()))
        time.sleep(0.3)
for k, tag in enumerate(DEVS):
    t = threading.Thread(target=sample); stop.clear(); t.start()
    p = subprocess.run([sys.executable, "-m", "pipeline", "extract", "--prepared", str(root / "prepared"), "--model", str(model),
                        "--out", str(root / f"run{k}"), "--device", tag, "--no-progress", "--json-stats"], capture_output=True, text=True)
    stop.set(); t.join()
    print(tag, "rc", p.returncode, p.stderr[-1500:], p.stdout[-400:], flush=True)
print("bus ids seen per run:", sorted(seen))
bus = subprocess.run(["nvidia-smi" if DEVS[0] != "cpu" else "true", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"], capture_output=True, text=True).stdout
print(bus)
worst, equal, n = 0.0, 0, 0
for i in range(96):
    a = formats.read_sample(root / "run0" / f"data_{i}.pt"); b = formats.read_sample(root / "run1" / f"data_{i}.pt")
    assert torch.equal(a["input_ids"], b["input_ids"])
    for x, y in zip(a["hidden_states"], b["hidden_states"]):
        n += 1; equal += torch.equal(x, y)
        worst = max(worst, float(((x.float() - y.float()).norm() / x.float().norm().clamp_min(1e-6))))
print(json.dumps({"tensors": n, "bitwise_equal": equal, "worst_rel_err": worst}))
