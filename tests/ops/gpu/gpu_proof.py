"""The GPU proof (issue item 8), run ON a GPU machine without sshd:
`python3 tests/ops/gpu/gpu_proof.py OUTDIR`.

Uses ops' local mode (`host = "local"`: the same code, commands through bash instead of SSH) with real
NVML, real fuser on /dev/nvidia*, and real torch processes holding GPU memory:
  idle gpu-clean (must pass) -> start a pid-file "server" (API parent + VLLM::EngineCore child holding
  memory), an orphan, and a holder named Xorg (protected) -> gpu-status -> gpu-clean --dry-run ->
  gpu-clean (server stopped, orphan killed, Xorg spared, so the clean check must FAIL, exit 6) ->
  stop our Xorg stand-in -> gpu-clean (must pass: no compute process, memory under the threshold).
Writes OUTDIR/transcript.md (every command and its output) and OUTDIR/results.json (pass/fail per step).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-proof-out")
OUT.mkdir(parents=True, exist_ok=True)
WORK = Path("/tmp/ops-gpu-proof")
WORK.mkdir(exist_ok=True)
PIDFILE = WORK / "server.pid"
# OPS_PROOF_REHEARSAL=1: the same flow on a machine without a GPU (holders keep a file open instead of
# GPU memory; the NVML part is a process table) to rehearse before spending device time
REHEARSAL = os.environ.get("OPS_PROOF_REHEARSAL") == "1"

HOLDER = r"""
import ctypes, os, signal, subprocess, sys, time
name, gib = sys.argv[1], float(sys.argv[2])
ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)
if os.environ.get("OPS_PROOF_REHEARSAL") == "1":
    x = open("/tmp/ops-gpu-proof/dev/nvidia0", "rb")
else:
    import torch
    x = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    x.fill_(1); torch.cuda.synchronize()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("ready", flush=True)
while True:
    time.sleep(1)
"""

SERVER = r"""
import os, signal, subprocess, sys, time
pidfile, holder = sys.argv[1], sys.argv[2]
child = subprocess.Popen([sys.executable, "-c", holder, "VLLM::EngineCore", "4"], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
def stop(*_):
    child.terminate(); child.wait(); sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(pidfile + ".tmp", "w").write(str(os.getpid())); os.rename(pidfile + ".tmp", pidfile)
print("ready", child.pid, flush=True)
while True:
    time.sleep(1)
"""  # noqa: E501

HOSTS = f"""[hosts.h200]
host = "local"
python = "{sys.executable}"
server = "pidfile:{PIDFILE}"
clean_threshold_mib = 1024
{'gpu_source = "table:/tmp/ops-gpu-proof/gpus.json"' if REHEARSAL else ""}
{'device_glob = "/tmp/ops-gpu-proof/dev/nvidia*"' if REHEARSAL else ""}
[hosts.h200.timeouts]
grace = 5
kill_wait = 5
stop = 20
clean = 10
"""

transcript: list[str] = []
results: dict = {"steps": []}


def ops(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ops", *args, "--host", "h200", "--hosts-file", str(WORK / "hosts.toml")]
    t = time.monotonic()
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, COLUMNS="160"))
    shown = "python -m ops " + " ".join(args) + " --host h200"
    transcript.append(
        f"$ {shown}    # exit {res.returncode}, {time.monotonic() - t:.1f} s\n{res.stdout}{res.stderr}"
    )
    return res


def step(name: str, ok: bool, detail: str = "") -> None:
    results["steps"].append({"step": name, "ok": bool(ok), "detail": detail})
    transcript.append(f"[{'PASS' if ok else 'FAIL'}] {name} {detail}\n")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


STARTED: list[int] = []


def start(argv: list[str]) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    STARTED.append(p.pid)
    line = p.stdout.readline().strip()
    if line.startswith("ready "):
        STARTED.append(int(line.split()[1]))
    return p, line


def as_json(res: subprocess.CompletedProcess) -> dict:
    try:
        return json.loads(res.stdout)
    except ValueError:
        return {
            "gpus": [{"memory_used_mib": None, "memory_used_v1_mib": None, "process_pids": ["?"]}],
            "holders": [],
        }


def table(procs: dict[int, int]) -> None:
    if REHEARSAL:
        (WORK / "gpus.json").write_text(
            json.dumps(
                {
                    "gpus": [
                        {
                            "name": "rehearsal",
                            "base_used_mib": 600,
                            "processes": [{"pid": p, "used_mib": m} for p, m in procs.items()],
                        }
                    ]
                }
            )
        )


def main() -> None:
    (WORK / "hosts.toml").write_text(HOSTS)
    if REHEARSAL:
        (WORK / "dev").mkdir(exist_ok=True)
        (WORK / "dev" / "nvidia0").write_bytes(b"")
        table({})
    else:
        nv = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.used,memory.total", "--format=csv"],
            capture_output=True,
            text=True,
        )
        transcript.append(f"$ nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv\n{nv.stdout}")
    idle = ops("gpu-status", "--json")
    state = as_json(idle)
    g = state["gpus"][0]
    step(
        "idle NVML facts",
        idle.returncode == 0,
        f"v2 used {g['memory_used_mib']} MiB, v1 used {g['memory_used_v1_mib']} MiB, "
        f"processes {g['process_pids']}",
    )
    res = ops("gpu-clean")
    step("idle GPU verifies clean", res.returncode == 0 and "clean (nothing to do)" in res.stdout)

    server, line = start([sys.executable, "-c", SERVER, str(PIDFILE), HOLDER])
    engine = int(line.split()[1])
    orphan, _ = start([sys.executable, "-c", HOLDER, "orphan-trainer", "2"])
    xorg, _ = start([sys.executable, "-c", HOLDER, "Xorg", "1"])
    pids = {"api": server.pid, "engine": engine, "orphan": orphan.pid, "xorg": xorg.pid}
    table({engine: 4096, orphan.pid: 2048, xorg.pid: 1024})
    results["pids"] = pids
    res = ops("gpu-status")
    st = as_json(ops("gpu-status", "--json"))
    klass = {h["proc"]["pid"]: h["klass"] for h in st["holders"]}
    step(
        "gpu-status classifies",
        klass.get(engine) == "server"
        and klass.get(orphan.pid) == "orphan"
        and klass.get(xorg.pid) == "protected",
        json.dumps({str(k): v for k, v in klass.items()}),
    )
    res = ops("gpu-clean", "--dry-run")
    step("dry run touches nothing", res.returncode == 0 and all(alive(p) for p in pids.values()))
    res = ops("gpu-clean")
    step(
        "gpu-clean with a protected holder left: not clean, exit 6",
        res.returncode == 6
        and not alive(engine)
        and not alive(server.pid)
        and not alive(orphan.pid)
        and alive(xorg.pid),
        f"exit {res.returncode}",
    )
    xorg.terminate()
    xorg.wait()
    for p in (server, orphan):
        p.wait()
    res = ops("gpu-clean")
    step("after the protected holder exits: clean, exit 0", res.returncode == 0 and "clean" in res.stdout)
    final = as_json(ops("gpu-status", "--json"))["gpus"][0]
    step(
        "final NVML facts",
        not final["process_pids"],
        f"v2 used {final['memory_used_mib']} MiB, v1 used {final['memory_used_v1_mib']} MiB",
    )
    results["ok"] = all(s["ok"] for s in results["steps"])


if __name__ == "__main__":
    try:
        main()
    finally:
        for pid in STARTED:  # new sessions outlive the command on the device machine: end them here
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        (OUT / "transcript.md").write_text("\n".join(transcript))
        (OUT / "results.json").write_text(json.dumps(results, indent=2))
        print("\n".join(transcript))
        print(json.dumps(results, indent=2))
