"""`make bench-ops`: remote-extract's own overhead against a loopback sshd, and the SSH connections it opens.

Overhead = the command's wall time minus the stage container's runtime (docker's StartedAt..FinishedAt):
connect, preflight, server stop, holder kill, verify clean, container start, log follow, summary fetch,
server restore. Connections are counted from sshd's VERBOSE log. Prints one line per run and a summary.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

from ops_helpers import REPO, loopback_hosts  # noqa: E402
from ops_docker import client, remove_test_containers, server_on_one_gpu, stage_image  # noqa: E402
from ops_sshd import start_sshd  # noqa: E402

RUNS = int(os.environ.get("BENCH_RUNS", "3"))


def ts(text: str) -> float:
    # docker prints RFC 3339 with nanoseconds; keep microseconds for fromisoformat
    head, _, frac = text.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}+00:00").timestamp()


def bench_scene(tmp: Path, dk, label: str = "bench") -> dict:
    """The loopback 'GPU host' of the ops benchmarks: a real sshd, a server container holding the one GPU,
    a tiny real model and its prepared samples, the stage image, and its hosts file (host `label`)."""
    img, mounts = stage_image(dk, REPO, sys.base_prefix)
    sshd = start_sshd(tmp / "sshd")
    data, assets = tmp / "data", tmp / "assets"
    (data / "cache").mkdir(parents=True)
    py = [sys.executable, "-m", "pipeline"]
    subprocess.run(
        [*py, "demo-assets", "--out", str(assets), "--conversations", "6"],
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    subprocess.run(
        [
            *py,
            "prepare",
            "--data",
            str(assets / "conversations.jsonl"),
            "--model",
            str(assets / "model"),
            "--out",
            str(data / "prepared"),
        ],
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    server, devdir, table = server_on_one_gpu(dk, tmp, "ops-bench-server", used_mib=1)
    hosts = loopback_hosts(
        tmp / "hosts.toml",
        label,
        sshd,
        server.name,
        devdir,
        table,
        (img, mounts),
        data,
        assets / "model",
        {"grace": 2, "kill_wait": 2, "stop": 10, "clean": 10},
    )
    return dict(sshd=sshd, server=server, hosts=hosts, data=data)


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-ops-"))
    dk = client()
    scene = bench_scene(tmp, dk)
    sshd, server, hosts, data, name = (
        scene["sshd"],
        scene["server"],
        scene["hosts"],
        scene["data"],
        scene["server"].name,
    )
    rows = []
    try:
        for i in range(RUNS):
            shutil.rmtree(data / "hidden_states", ignore_errors=True)
            server.reload()
            if server.status != "running":
                server.start()
            before = sshd.connections()
            start = time.monotonic()
            res = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "ops",
                    "remote-extract",
                    "--host",
                    "bench",
                    "--hosts-file",
                    str(hosts),
                    "--run-id",
                    f"bench{i}",
                    "--restore-server",
                    "--runs-dir",
                    str(tmp / "runs"),
                ],
                cwd=REPO,
                capture_output=True,
                text=True,
                env=dict(os.environ, EAGLE_OPS_TRACE=str(tmp / f"trace{i}.jsonl")),
            )
            wall = time.monotonic() - start
            if res.returncode != 0:
                sys.exit(f"run {i} failed:\n{res.stdout[-2000:]}\n{res.stderr}")
            c = json.loads((tmp / "runs" / "bench" / f"bench{i}" / "container.json").read_text())
            stage = ts(c["finished_at"]) - ts(c["started_at"])
            conns = sshd.connections() - before
            rows.append((wall, stage, wall - stage, conns))
            trace = [json.loads(x) for x in (tmp / f"trace{i}.jsonl").read_text().splitlines()]
            slow = sorted(trace, key=lambda r: -r["seconds"])[:4]
            remote = sum(r["seconds"] for r in trace)
            print(
                f"  {len(trace)} remote commands, {remote:.2f} s in them (log follow included), "
                f"{wall - remote:.2f} s outside them (interpreter start, imports, connect, local work)"
            )
            print(
                "  slowest remote commands: "
                + "; ".join(f"{r['seconds']:.2f} s {r['command'][:60]}" for r in slow)
            )
            print(
                f"run {i}: wall {wall:.2f} s, stage {stage:.2f} s, overhead {wall - stage:.2f} s, "
                f"SSH connections {conns}"
            )
    finally:
        remove_test_containers(dk, [name])
        sshd.stop()
    over = sorted(r[2] for r in rows)
    print(
        f"overhead median {over[len(over) // 2]:.2f} s (min {over[0]:.2f}, max {over[-1]:.2f}) "
        f"over {RUNS} runs; "
        f"SSH connections per run: {sorted({r[3] for r in rows})}; goal <= 3 s and 1; "
        f"load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
