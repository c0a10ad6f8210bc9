"""remote-extract over several hosts end to end: two real sshd on loopback, each "host" with its own Docker
engine (a private dockerd each, so that no other test's stage container on the shared engine makes a
host "busy") and its own data disk, the real `pipeline extract`
sharded by --world-size/--rank in the stage containers, summaries fetched and merged."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ops_docker import client, stage_image
from ops_dockerd import start_engine
from ops_helpers import REPO, run_ops, ssh_table, write_hosts
from ops_procs import write_gpu_table
from ops_sshd import start_sshd

pytestmark = [pytest.mark.sshd, pytest.mark.docker, pytest.mark.slow]

FAST = {"grace": 1, "kill_wait": 2, "stop": 3, "clean": 3}
SAMPLES = 7  # odd: the two shards differ in size (4 and 3 files)
A, B = "mh-a", "mh-b"  # host names; also the label that finds their stage containers


@pytest.fixture(scope="module")
def image():
    return stage_image(client(), REPO, sys.base_prefix)


@pytest.fixture(scope="module")
def engines(image):
    """Each host's own Docker engine, with the stage image copied in."""
    started = []
    try:
        for _ in (A, B):
            started.append(start_engine())
            started[-1].load(image[0])
        yield dict(zip((A, B), started))
    finally:
        for eng in started:
            eng.stop()


@pytest.fixture(scope="module")
def servers(tmp_path_factory, engines):
    """One sshd per host; its sessions talk to that host's engine (sshd SetEnv DOCKER_HOST)."""
    root = tmp_path_factory.mktemp("sshds")
    out = {name: start_sshd(root / name, env={"DOCKER_HOST": eng.socket}) for name, eng in engines.items()}
    yield out
    for sshd in out.values():
        sshd.stop()


@pytest.fixture(scope="module")
def assets(tmp_path_factory, warm_pipeline):
    """A tiny real model and its prepared samples (pipeline demo-assets + prepare, warm:
    tests/warm_cli.py)."""
    root = tmp_path_factory.mktemp("assets")
    env = {"PYTHONDONTWRITEBYTECODE": "1"}
    warm_pipeline("demo-assets", "--out", root, "--conversations", SAMPLES, check=True, env=env)
    warm_pipeline(
        "prepare",
        "--data",
        root / "conversations.jsonl",
        "--model",
        root / "model",
        "--out",
        root / "prepared",
        check=True,
        env=env,
    )
    return root


@pytest.fixture(autouse=True)
def no_stage_containers(engines):
    """Each test starts with no container on the hosts' engines (a failing test may leave one)."""
    for eng in engines.values():
        for ctr in eng.client().containers.list(all=True):
            ctr.remove(force=True)


@pytest.fixture
def hosts(tmp_path, servers, assets, image):
    """A hosts file naming a and b; each host has its own data root (its own disk) holding the prepared
    samples, its own (empty) GPU table and device folder."""
    img, mounts = image
    texts = []
    for name, sshd in servers.items():
        data = tmp_path / f"disk-{name}"
        shutil.copytree(assets / "prepared", data / "prepared")
        (data / "cache").mkdir()
        dev = tmp_path / f"dev-{name}"
        dev.mkdir()
        (dev / "nvidia0").write_bytes(b"")
        table = write_gpu_table(tmp_path / f"gpus-{name}.json", [{"processes": []}])
        known = sshd.write_known_hosts(tmp_path / f"known-{name}")
        path = write_hosts(
            tmp_path / f"{name}.toml",
            name,
            **ssh_table(
                sshd,
                known,
                device_glob=f"{dev}/nvidia*",
                gpu_source=f"table:{table}",
                timeouts=FAST,
                image=img,
                docker_gpus="",
                mounts=mounts,
                data_root=str(data),
                model_dir=str(assets / "model"),
                cache_dir=str(data / "cache"),
                lock_file=str(data / "eagle-ops.lock"),
            ),
        )  # one lock per host
        texts.append(path.read_text())
    out = tmp_path / "hosts.toml"
    out.write_text("\n".join(texts))
    return out


def extract(hosts: Path, runs: Path, *args: str) -> subprocess.CompletedProcess:
    return run_ops(
        "remote-extract",
        "--host",
        f"{A},{B}",
        "--hosts-file",
        str(hosts),
        "--runs-dir",
        str(runs),
        *args,
        timeout=600,
    )


def interrupt_when(
    hosts: Path, tmp_path: Path, run_id: str, lines_before: list[str], **env: str
) -> tuple[int, str]:
    """remote-extract on both hosts, one SIGINT once every line of `lines_before` has begun an output line
    (a line wanted twice is listed twice); its exit code and whole output."""
    cmd = [
        sys.executable,
        "-m",
        "ops",
        "remote-extract",
        "--host",
        f"{A},{B}",
        "--hosts-file",
        str(hosts),
        "--runs-dir",
        str(tmp_path / "runs"),
        "--run-id",
        run_id,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, COLUMNS="200", **env),
    )
    lines, waiting = [], list(lines_before)
    for line in proc.stdout:
        lines.append(line)
        waiting = [w for w in waiting if not line.startswith(w)] + [w for w in waiting if line.startswith(w)][
            1:
        ]
        if not waiting:
            break
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    return proc.returncode, "".join(lines) + rest


def files(disk: Path) -> list[int]:
    return sorted(int(p.stem[5:]) for p in (disk / "hidden_states").glob("data_*.pt"))


def test_two_hosts_write_one_verified_set(hosts, tmp_path, servers):
    """Hosts mh-a and mh-b each extract their own shard over one connection each; the merged summary covers
    every file exactly once, the two shards copied together verify as one set, and `remote-run verify`
    over both hosts verifies each shard where it lies."""
    before = {n: s.connections() for n, s in servers.items()}
    res = extract(hosts, tmp_path / "runs", "--run-id", "m1")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr
    assert files(tmp_path / f"disk-{A}") == [0, 2, 4, 6] and files(tmp_path / f"disk-{B}") == [1, 3, 5]
    assert {n: s.connections() - before[n] for n, s in servers.items()} == {A: 1, B: 1}
    merged = json.loads((tmp_path / "runs" / "m1" / "summary.json").read_text())
    lengths = json.loads((tmp_path / f"disk-{A}" / "hidden_states" / "sample_lengths.json").read_text())
    assert merged["complete"] and merged["totals"]["files"] == SAMPLES == merged["totals"]["samples"]
    assert merged["totals"]["missing_files"] == [] and merged["totals"]["complete_ranks"] == [0, 1]
    assert merged["totals"]["tokens"] == sum(lengths.values())
    assert [(h["host"], h["rank"], h["status"], h["files"]) for h in merged["hosts"]] == [
        (A, 0, "ok", 4),
        (B, 1, "ok", 3),
    ]
    for name in (A, B):
        assert json.loads((tmp_path / "runs" / "m1" / name / "summary.json").read_text())["ok"]
        assert f"{name} | started eagle-m1" in res.stdout
    assert "all 2 shards complete" in res.stdout
    together = tmp_path / "together"
    shutil.copytree(tmp_path / f"disk-{A}" / "hidden_states", together)
    # a merged set carries every host's files and its checksum index (docs/ops.md: merging hosts)
    for p in [
        *(tmp_path / f"disk-{B}" / "hidden_states").glob("data_*.pt"),
        *(tmp_path / f"disk-{B}" / "hidden_states").glob("checksums*.json"),
    ]:
        shutil.copy(p, together / p.name)
    check = subprocess.run(
        [sys.executable, "-m", "pipeline", "verify", str(together)], cwd=REPO, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr
    verified = run_ops(
        "remote-run",
        "verify",
        "--host",
        f"{A},{B}",
        "--hosts-file",
        str(hosts),
        "--runs-dir",
        str(tmp_path / "runs"),
        "--run-id",
        "v1",
        timeout=600,
    )
    assert verified.returncode == 0, verified.stdout[-4000:] + verified.stderr
    assert (
        f"{B} | started eagle-v1: python -m pipeline verify /data/hidden_states --world-size 2 --rank 1"
        in verified.stdout
    )
    assert json.loads((tmp_path / "runs" / "v1" / "summary.json").read_text())["totals"][
        "complete_ranks"
    ] == [0, 1]


def test_failed_host_is_a_row_and_rerun_redoes_only_it(hosts, tmp_path, servers):
    """Host b unreachable: its row says refused, host a's shard completes intact, exit 13; after b is
    back, `--resume` skips a without even connecting to it (files untouched) and completes b."""
    runs = tmp_path / "runs"
    servers[B].stop()
    try:
        res = extract(hosts, runs, "--run-id", "m2")
    finally:
        servers[B].start_again()
    assert res.returncode == 13, res.stdout[-4000:] + res.stderr
    merged = json.loads((runs / "m2" / "summary.json").read_text())
    a, b = merged["hosts"]
    assert a["status"] == "ok" and a["complete"] and b["status"] == "failed" and not b["complete"]
    assert b["exit_code"] == 3 and "refused" in b["error"]
    assert merged["totals"]["complete_ranks"] == [0] and merged["totals"]["missing_files"] == [1, 3, 5]
    assert files(tmp_path / f"disk-{A}") == [0, 2, 4, 6] and files(tmp_path / f"disk-{B}") == []
    assert "refused" in res.stdout and "incomplete" in res.stdout
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / f"disk-{A}" / "hidden_states").iterdir()}

    seen_a = servers[A].connections()
    again = extract(hosts, runs, "--resume")
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr
    assert "skipped: shard 0/2 verified complete" in again.stdout
    assert servers[A].connections() == seen_a
    assert {
        p.name: p.stat().st_mtime_ns for p in (tmp_path / f"disk-{A}" / "hidden_states").iterdir()
    } == stamps
    assert files(tmp_path / f"disk-{B}") == [1, 3, 5]
    merged = json.loads((runs / "m2" / "summary.json").read_text())
    assert merged["complete"] and merged["attempts"] == 2 and merged["totals"]["files"] == SAMPLES
    assert [h["status"] for h in merged["hosts"]] == ["skipped", "ok"]


def test_partial_shard_resumes_only_its_missing_files(hosts, tmp_path):
    """Host b's disk fills up mid-extract (its output a tmpfs with room for 2 of its 3 files: 4 inodes, so
    that preflight's byte count passes): its row names the stage's error,
    exit 13; after space is freed the re-run skips a, and b's --resume writes only its missing files
    (those written before keep their mtimes); the set is complete."""
    runs, out_b = tmp_path / "runs", tmp_path / f"disk-{B}" / "hidden_states"
    out_b.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,nr_inodes=4", "tmpfs", str(out_b)], check=True)
    try:
        # one sample per batch, so that a resumed run has whole batches to skip
        res = extract(hosts, runs, "--run-id", "p1", "--", "--max-batch-size", "1")
        assert res.returncode == 13, res.stdout[-4000:] + res.stderr
        a, b = json.loads((runs / "p1" / "summary.json").read_text())["hosts"]
        assert a["complete"] and b["status"] == "failed" and "No space left on device" in b["error"], b
        written = {p.name: p.stat().st_mtime_ns for p in out_b.glob("data_*.pt")}
        assert written and len(written) < 3, written
        subprocess.run(["mount", "-o", "remount,nr_inodes=1000", str(out_b)], check=True)
        again = extract(hosts, runs, "--run-id", "p1", "--", "--max-batch-size", "1")
        assert again.returncode == 0, again.stdout[-4000:] + again.stderr
        assert f"{B} | extracted 7 samples" in again.stdout and f"{len(written)} already done" in again.stdout
        assert {n: (out_b / n).stat().st_mtime_ns for n in written} == written
        assert files(tmp_path / f"disk-{B}") == [1, 3, 5]
        assert json.loads((runs / "p1" / "summary.json").read_text())["complete"]
    finally:
        subprocess.run(["umount", str(out_b)], check=True)


def test_ctrl_c_stops_the_stage_on_every_host(hosts, tmp_path, engines):
    """Ctrl-C while both hosts run their stage: each host's container is stopped and removed (by that
    host's own flow), the record says interrupted for both, exit 130."""
    code, text = interrupt_when(hosts, tmp_path, "int1", [f"{n} | started eagle-int1" for n in (A, B)])
    assert code == 130, text[-4000:]
    for name, eng in engines.items():
        assert f"{name} | interrupted: stopping container eagle-int1" in text, text
        # stopped, its log kept, and removed: nothing is left behind (the Ctrl-C policy of ops.remote_run)
        assert not eng.client().containers.list(all=True, filters={"name": "eagle-int1"})
    merged = json.loads((tmp_path / "runs" / "int1" / "summary.json").read_text())
    assert [(h["status"], h["error"]) for h in merged["hosts"]] == [("failed", "interrupted")] * 2


def test_ctrl_c_in_a_step_lets_every_host_finish_that_step_first(hosts, tmp_path, engines):
    """Ctrl-C while both hosts are inside the `start` step (paused there by the test seam): as in a
    one-host run, each host finishes the step (its stage container starts) and stops at the next step
    boundary, where its own flow stops, logs and removes that container; nothing lands mid-step."""
    code, text = interrupt_when(hosts, tmp_path, "int2", ["paused at start"] * 2, EAGLE_OPS_PAUSE_AT="start")
    assert code == 130, text[-4000:]
    for name, eng in engines.items():
        assert f"{name} | Ctrl-C: finishing the current step, then stopping" in text, text
        assert f"{name} | started eagle-int2" in text, text  # the step ran to its end
        assert f"{name} | interrupted: stopping container eagle-int2" in text, text
        assert not eng.client().containers.list(all=True, filters={"name": "eagle-int2"})
        state = json.loads((tmp_path / "runs" / "int2" / name / "state.json").read_text())
        assert (state["status"], state["step"], state["container_removed"]) == (
            "interrupted",
            "start",
            True,
        ), state
        assert (tmp_path / "runs" / "int2" / name / "stage.log").exists()
