# Scratch script behind 0608-verify-read-variants.log, kept for the record: it patches formats.read_sample under
# the verify of commit 1c505c1 (mmap_rN = that verify, read_rN = torch.load without mmap, into_rN = the
# prototype of pipeline/sample_buffer.py). Against later verify code the patch no longer selects the path.
"""Scratch (not committed): where verify's time goes on big sets. Variants of the data-file read, same checks."""
import json, os, pickle, shutil, subprocess, sys, threading, time
from pathlib import Path
import torch
from bench.verify_bench import make_set
from bench.scaling_bench import naive_verify
from pipeline import formats
from pipeline import verify as V

orig = formats.read_sample
BUFS = {}
DT = {"BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "HalfStorage": torch.float16, "FloatStorage": torch.float32}

def read_into(path, mmap=False):
    n = os.path.getsize(path)
    k = threading.current_thread().name.rsplit("_", 1)[-1]
    buf = BUFS.get(k)
    if buf is None or buf.numel() < n:
        buf = BUFS[k] = torch.empty(max(n, 64 << 20), dtype=torch.uint8); buf.fill_(0)
    with open(path, "rb", buffering=0) as f:
        got = f.readinto(memoryview(buf.numpy())[:n])
    assert got == n
    r = torch._C.PyTorchFileReader(str(path))
    class U(pickle.Unpickler):
        def find_class(self, m, name):
            if (m, name) == ("torch._utils", "_rebuild_tensor_v2"):
                return lambda s, off, size, stride, *a: s.as_strided(size, stride, s.storage_offset() + off)
            if m == "torch" and name in DT: return DT[name]
            if (m, name) == ("collections", "OrderedDict"): return dict
            raise pickle.UnpicklingError(name)
        def persistent_load(self, pid):
            _, dtype, key, _, numel = pid
            off = r.get_record_offset(f"data/{key}")
            return buf[off: off + numel * dtype.itemsize].view(dtype)
    import io
    return U(io.BytesIO(r.get_record("data.pkl"))).load()

def timed(fn):
    t = time.perf_counter(); fn(); return time.perf_counter() - t

def run(states, tag, readers, reader):
    formats.read_sample = reader
    try:
        s = V.verify(V.VerifyConfig(path=states, workers=readers, write_summary=False))
        assert s.ok, [c.detail for c in s.checks if c.status == "fail"][:3]
    finally:
        formats.read_sample = orig

nommap = lambda p, mmap=False: orig(p, mmap=False)
for gb in [float(x) for x in sys.argv[1].split(",")]:
    root = Path(sys.argv[2]); shutil.rmtree(root, ignore_errors=True); root.mkdir(parents=True)
    t0 = time.perf_counter(); states = make_set(root, gb, 2048, 2048); build = time.perf_counter() - t0
    nbytes = sum(f.stat().st_size for f in states.glob("data_*.pt"))
    variants = {"naive": lambda: naive_verify(states)}
    for R in (2, 4, 8):
        variants[f"mmap_r{R}"] = lambda R=R: run(states, "mmap", R, orig)
        variants[f"read_r{R}"] = lambda R=R: run(states, "read", R, nommap)
        variants[f"into_r{R}"] = lambda R=R: run(states, "into", R, read_into)
    times = {}
    for _ in range(2):
        for k, f in variants.items():
            times.setdefault(k, []).append(timed(f))
    best = {k: min(v) for k, v in times.items()}
    print(json.dumps({"gb": nbytes / 1e9, "files": len(list(states.glob('data_*.pt'))), "build_s": build,
                      "gb_s": {k: round(nbytes / v / 1e9, 2) for k, v in best.items()},
                      "vs_naive": {k: round(best["naive"] / v, 2) for k, v in best.items()}}), flush=True)
    shutil.rmtree(root)
