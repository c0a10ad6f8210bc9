"""Where the seconds after `pipeline extract`'s closing line go (issue #21, whole process), on one GPU.

Builds the llama-1b preset and a prepared set in /dev/shm, then runs `pipeline extract` (default flags) as
fresh processes in turns: `plain` (python -m pipeline), `stamped` (the same CLI in process, with an atexit
hook registered first, so it runs after every other atexit handler, that prints its process age) and
`exit` (the same, then os._exit(0) once the command returned and stdout/stderr are flushed: no interpreter
or CUDA teardown). Prints, per run: wall, the closing line's age, the last output line's age and, for
`stamped`, the age at the last atexit handler; the seconds after it are module and CUDA teardown.

    PYTHONPATH=. python3 docs/benchmarks-raw/2026-12-03/tail_probe.py 256
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from bench.timing import timed

W = Path("/dev/shm/tail")
WRAP = r"""
import atexit, os, sys, time
t0 = float(os.environ["PROBE_T0"])
atexit.register(lambda: print(f"PROBE atexit {time.time() - t0:.2f}", file=sys.stderr, flush=True))
from pipeline.cli import run
sys.argv = ["pipeline", *sys.argv[1:]]
try:
    run()
finally:
    if os.environ.get("PROBE_EXIT"):
        print(f"PROBE os_exit {time.time() - t0:.2f}", file=sys.stderr, flush=True)
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(0)
"""


def main(n: int, shape: str = "llama-1b", device: str = "cuda") -> None:
    import time

    from bench.extract_bench import make_prepared
    from bench.gpu_models import build_model, save_model

    shutil.rmtree(W, ignore_errors=True)
    W.mkdir(parents=True)
    m = build_model(shape, device)
    save_model(m, W / "model")
    vocab = m.config.vocab_size
    del m
    make_prepared(W / "prep", n, 2048 if shape != "tiny" else 256, vocab)
    args = ["extract", "--prepared", str(W / "prep"), "--model", str(W / "model"), "--out", str(W / "o")]
    args += ["--no-progress"]
    rows = []
    for kind in ["plain", "stamped", "exit", "plain", "stamped", "exit", "plain"]:
        env = dict(__import__("os").environ, PROBE_T0=repr(time.time()))
        if kind == "plain":
            argv = [sys.executable, "-m", "pipeline", *args]
        else:
            argv = [sys.executable, "-c", WRAP, *args]
            if kind == "exit":
                env["PROBE_EXIT"] = "1"
        t = timed(argv, env=env)
        closing = next((s for s, line in t.lines if line.startswith("extracted ")), None)
        probes = {line.split()[1]: float(line.split()[2]) for _, line in t.lines if line.startswith("PROBE")}
        last = max((s for s, line in t.lines if not line.startswith("PROBE")), default=None)
        row = dict(kind=kind, rc=t.returncode, wall=round(t.wall, 2), closing_line=closing, last_line=last)
        row.update(probes)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if t.returncode:
            print(t.tail(), flush=True)
        shutil.rmtree(W / "o", ignore_errors=True)
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv"], check=False)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 256, *sys.argv[2:])
