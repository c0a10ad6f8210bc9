# Scratch script behind 0850-dp-probe-*.{log,json,csv} (run: PYTHONPATH=. python dp_probe.py /dev/shm/probe 1024 2 out.json).
"""is DP=2's slower GPU time per token our code, or two GPUs working at once?
A = one extract on GPU0 alone; B = two independent single-GPU extracts at once (GPU0, GPU1);
C = extract --data-parallel 2. Alternating A,B,C rounds; nvidia-smi sampled every 250 ms."""
import json, os, shutil, subprocess, sys, threading, time
from pathlib import Path
from bench.extract_bench import PRESETS, make_prepared
from pipeline.tiny import build_tiny_model

root = Path(sys.argv[1]); samples = int(sys.argv[2]); rounds = int(sys.argv[3]); out_json = Path(sys.argv[4])
shutil.rmtree(root, ignore_errors=True); root.mkdir(parents=True)
PRESET = sys.argv[5] if len(sys.argv) > 5 else "llama-1b"
overrides, _, seq, _ = PRESETS[PRESET]
model = build_tiny_model("llama", root / "model", **overrides)
make_prepared(root / "prepared", samples, seq, overrides.get("vocab_size", 1024))
phase = {"name": "idle"}; smi = []; stop = threading.Event()
def sampler():
    while shutil.which("nvidia-smi") and not stop.is_set():
        o = subprocess.run(["nvidia-smi", "--query-gpu=index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
        for line in o.strip().splitlines():
            f = [x.strip() for x in line.split(",")]
            smi.append({"phase": phase["name"], "t": time.time(), "gpu": int(f[0]), "sm": float(f[1]), "mem": float(f[2]),
                        "power": float(f[3]), "temp": float(f[4]), "util": float(f[5]), "throttle": f[6]})
        time.sleep(0.25)
threading.Thread(target=sampler, daemon=True).start()
def extract(out, dp, gpus):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus)
    return subprocess.Popen([sys.executable, "-m", "pipeline", "extract", "--prepared", str(root / "prepared"), "--model", str(model),
                             "--out", str(out), "--data-parallel", str(dp), "--max-batch-tokens", "32768", "--no-verify",
                             "--no-progress", "--json-stats"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
def finish(p):
    o, e = p.communicate()
    if p.returncode: raise SystemExit(e[-2000:])
    s = json.loads(o.strip().splitlines()[-1])
    ws = s.get("workers") or [s]
    return [{"tokens": w["tokens"], "seconds": round(w.get("seconds", 0), 3), "busy_us_per_tok": round(w.get("device_busy_seconds", 0) / max(w["tokens"], 1) * 1e6, 3),
             "idle": w.get("device_idle_fraction"), "writer_wait": w.get("writer_wait_seconds")} for w in ws]
runs = []
for r in range(rounds):
    for name in ("A", "B", "C"):
        phase["name"] = f"{name}{r}"; t0 = time.time()
        if name == "A":
            res = finish(extract(root / "a", 1, "0"))
        elif name == "B":
            ps = [extract(root / "b0", 1, "0"), extract(root / "b1", 1, "1")]
            res = [finish(p)[0] for p in ps]
        else:
            res = finish(extract(root / "c", 2, "0,1"))
        for d in ("a", "b0", "b1", "c"):
            shutil.rmtree(root / d, ignore_errors=True)
        rec = {"run": phase["name"], "wall": round(time.time() - t0, 1), "workers": res}
        # clocks while the GPUs were busy (util > 50) in this phase
        for g in (0, 1):
            xs = [x for x in smi if x["phase"] == phase["name"] and x["gpu"] == g and x["util"] > 50]
            if xs:
                rec[f"gpu{g}"] = {"n": len(xs), "sm_mhz": round(sum(x["sm"] for x in xs) / len(xs)), "power_w": round(sum(x["power"] for x in xs) / len(xs)),
                                  "temp_max": max(x["temp"] for x in xs), "throttle": sorted({x["throttle"] for x in xs})}
        runs.append(rec); print(json.dumps(rec), flush=True)
stop.set()
out_json.write_text(json.dumps({"runs": runs, "smi": smi}) + "\n")
