"""Benchmark: how soon `remote-extract` refuses a misconfigured run, from the laptop command to its error
line.

Against a loopback "GPU host" (a real sshd, the real Docker engine, a server container holding the one
GPU, a tiny real model and prepared samples: tests/ops/bench_ops.py `bench_scene`), each misconfiguration
runs `python -m ops remote-extract` from a cold interpreter start; stderr is read as it comes and the
seconds to the `error: preflight failed: ...` line are taken, with the exit code, whether the server
container kept running (same start time), and where the time went (EAGLE_OPS_TRACE: the look into the
image and the preflight container, each a `docker run --rm`).

    python bench/remote_preflight_bench.py [--runs 3] [--json-out runs/remote_preflight_bench.json]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "ops"), str(REPO)]

from bench_ops import bench_scene  # noqa: E402
from ops_docker import client, remove_test_containers  # noqa: E402

CASES = {  # name -> arguments after `--` that make the run misconfigured
    "wrong layer ids": ("--layer-ids", "0,1,2"),
    "misspelt option": ("--layer-id", "0,1,2,3"),
}


def timed(argv: list[str], env: dict) -> tuple[float | None, float, int, str]:
    """Seconds to the first `error:` line on stderr, to exit, the exit code, that line."""
    start = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    first, line = None, ""
    for text in proc.stderr:
        if first is None and text.startswith("error:"):
            first, line = time.monotonic() - start, text.strip()
    proc.wait()
    return first, time.monotonic() - start, proc.returncode, line


@click.command()
@click.option("--runs", type=int, default=3, show_default=True, help="Runs per case.")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(runs: int, json_out: Path | None) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-remote-preflight-"))
    dk = client()
    scene = bench_scene(tmp, dk, "pfbench")
    server = scene["server"]
    rows = []
    try:
        for case, extra in CASES.items():
            for i in range(runs):
                server.reload()
                started = server.attrs["State"]["StartedAt"]
                trace = tmp / f"trace-{len(rows)}.jsonl"
                env = dict(os.environ, EAGLE_OPS_TRACE=str(trace))
                argv = [
                    sys.executable,
                    "-m",
                    "ops",
                    "remote-extract",
                    "--host",
                    "pfbench",
                    "--hosts-file",
                    str(scene["hosts"]),
                    "--run-id",
                    f"pfb{len(rows)}",
                    "--runs-dir",
                    str(tmp / "runs"),
                    "--",
                    *extra,
                ]
                to_error, wall, code, line = timed(argv, env)
                server.reload()
                kept = server.status == "running" and server.attrs["State"]["StartedAt"] == started
                cmds = [json.loads(x) for x in trace.read_text().splitlines()] if trace.exists() else []
                containers = [c["seconds"] for c in cmds if c["command"].startswith("docker run --rm")]
                row = {
                    "case": case,
                    "run": i,
                    "seconds_to_error_line": to_error,
                    "seconds_to_exit": round(wall, 2),
                    "exit_code": code,
                    "error_line": line,
                    "server_kept_running": kept,
                    "container_seconds": [round(s, 2) for s in containers],
                    "remote_seconds": round(sum(c["seconds"] for c in cmds), 2),
                }
                rows.append(row)
                print(
                    f"{case} run {i}: error line after "
                    f"{to_error if to_error is None else round(to_error, 2)} s, "
                    f"exit {code} after {wall:.2f} s, server kept running: {kept}; containers "
                    f"{' + '.join(f'{s:.2f}' for s in containers)} s; {line}"
                )
                if code != 4 or not kept:
                    sys.exit(f"expected exit 4 with the server untouched: {row}")
    finally:
        remove_test_containers(dk, [server.name])
        scene["sshd"].stop()
        shutil.rmtree(tmp, ignore_errors=True)
    for case in CASES:
        secs = sorted(r["seconds_to_error_line"] for r in rows if r["case"] == case)
        print(
            f"{case}: laptop command to error line median {secs[len(secs) // 2]:.2f} s "
            f"(min {secs[0]:.2f}, max {secs[-1]:.2f}) over {len(secs)} runs; "
            f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
        )
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = json_out.with_suffix(".tmp")
        tmp_out.write_text(json.dumps({"rows": rows, "load_average": os.getloadavg()[0]}, indent=1))
        tmp_out.rename(json_out)


if __name__ == "__main__":
    main()
