"""remote-extract / remote-run / attach end to end: real sshd, real dockerd, a real pipeline stage on
real files in the stage container, the server container stopped and restored, one SSH connection."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ops_helpers import REPO, run_ops, ssh_table, write_hosts
from ops_docker import client, holder_container, remove_test_containers, stage_image, unique
from ops_procs import alive, write_gpu_table

pytestmark = [pytest.mark.sshd, pytest.mark.docker]

FAST = {"grace": 1, "kill_wait": 2, "stop": 3, "clean": 3}
# a data root an unquoted shell would choke on (or worse, execute)
WEIRD = "data dir 'single' \"double\" $(touch PWNED) `touch PWNED2`"


@pytest.fixture(scope="module")
def dk():
    return client()


@pytest.fixture(scope="module")
def image(dk):
    return stage_image(dk, REPO, sys.base_prefix)


@pytest.fixture(scope="module")
def assets(tmp_path_factory, warm_pipeline):
    """A tiny real model and prepared samples (pipeline demo-assets + prepare, warm: tests/warm_cli.py),
    under a hostile path."""
    root = tmp_path_factory.mktemp("assets")
    data = root / WEIRD
    data.mkdir()
    (data / "cache").mkdir()
    env = {"PYTHONDONTWRITEBYTECODE": "1"}
    warm_pipeline("demo-assets", "--out", root / "assets", "--conversations", 6, check=True, env=env)
    warm_pipeline(
        "prepare",
        "--data",
        root / "assets" / "conversations.jsonl",
        "--model",
        root / "assets" / "model",
        "--out",
        data / "prepared",
        check=True,
        env=env,
    )
    return data, root / "assets" / "model"


@pytest.fixture(scope="module")
def scene(tmp_path_factory, dk, image, assets, sshd):
    """The 'GPU host': a server container holding the device, an orphan, the hosts file."""
    tmp = tmp_path_factory.mktemp("scene")
    data, model = assets
    devdir = tmp / "dev"
    devdir.mkdir()
    (devdir / "nvidia0").write_bytes(b"")
    name = unique("ops-test-server")
    server = holder_container(dk, name, devdir, [devdir / "nvidia0"])
    orphan = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time,sys; f=open(sys.argv[1]); time.sleep(600)",
            str(devdir / "nvidia0"),
        ]
    )
    table = write_gpu_table(
        tmp / "gpus.json",
        [
            {
                "processes": [
                    {"pid": server.attrs["State"]["Pid"], "used_mib": 9000},
                    {"pid": orphan.pid, "used_mib": 10},
                ]
            }
        ],
    )
    _remove_stage_containers(dk, data)
    known = sshd.write_known_hosts(tmp / "known_hosts")
    img, mounts = image
    hosts = write_hosts(
        tmp / "hosts.toml",
        "box",
        **ssh_table(
            sshd,
            known,
            server=f"container:{name}",
            device_glob=f"{devdir}/nvidia*",
            gpu_source=f"table:{table}",
            timeouts=FAST,
            image=img,
            docker_gpus="",
            mounts=mounts,
            data_root=str(data),
            model_dir=str(model),
            cache_dir=str(data / "cache"),
        ),
    )
    yield dict(tmp=tmp, data=data, server=server, orphan=orphan, hosts=hosts, name=name, runs=tmp / "runs")
    orphan.kill()
    orphan.wait()
    remove_test_containers(dk, [name])
    _remove_stage_containers(dk, data)


def _remove_stage_containers(dk, data: Path) -> None:
    """Stage containers of this scene's data root (other checkouts test on the same engine, also with a
    host named `box`: theirs are left alone)."""
    for ctr in dk.containers.list(all=True, filters={"label": "eagle-ops.host=box"}):
        if ctr.labels.get("eagle-ops.output", "").startswith(f"{data}/"):
            ctr.remove(force=True)


def ops(scene, *args, **kw):
    return run_ops(*args, "--host", "box", "--hosts-file", str(scene["hosts"]), **kw)


def start_until_started(scene, run_id: str, *extra: str) -> tuple[subprocess.Popen, list[str]]:
    """`remote-run verify` in the background, read until its stage container has started."""
    cmd = [
        sys.executable,
        "-m",
        "ops",
        "remote-run",
        "verify",
        "--run-id",
        run_id,
        *extra,
        "--host",
        "box",
        "--hosts-file",
        str(scene["hosts"]),
        "--runs-dir",
        str(scene["runs"]),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, COLUMNS="200"),
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(f"started eagle-{run_id}"):
            break
    return proc, lines


@pytest.fixture(scope="module")
def extracted(scene, sshd):
    before = sshd.connections()
    res = ops(
        scene,
        "remote-extract",
        "--run-id",
        "x1",
        "--restore-server",
        "--runs-dir",
        str(scene["runs"]),
        timeout=300,
    )
    return res, sshd.connections() - before


@pytest.mark.slow
def test_remote_extract_end_to_end(scene, extracted):
    """remote-extract stops the server container, kills the orphan, runs `pipeline extract` in the stage
    container, fetches summary.json and the log, restores the server, all over one SSH connection."""
    res, connections = extracted
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    local = scene["runs"] / "box" / "x1"
    summary = json.loads((local / "summary.json").read_text())
    assert summary["checks"] and all(c["status"] == "ok" for c in summary["checks"])
    assert "OK (0 failed checks)" in (local / "stage.log").read_text()
    run = json.loads((local / "run.json").read_text())
    assert run["exit_code"] == 0
    # the stage recorded the image it ran in: the digest ops read from the engine, through the container's env
    assert run["image_digest"] and summary["provenance"]["image_digest"] == run["image_digest"]
    assert sorted(p.name for p in (scene["data"] / "hidden_states").glob("data_*.pt")) == [
        f"data_{i}.pt" for i in range(6)
    ]
    scene["server"].reload()
    assert scene["server"].status == "running"
    assert "restored: start server: docker start" in res.stdout
    assert not alive(scene["orphan"].pid)
    assert connections == 1
    assert not list(scene["data"].parent.rglob("PWNED*")) and not Path("/root/PWNED").exists()


@pytest.mark.slow
def test_ssh_drop_leaves_container_running_and_attach_finishes(scene, extracted, dk):
    """Killing the operator's process mid-follow does not stop the stage container; attach follows it
    again, propagates its exit code and fetches its summary."""
    assert extracted[0].returncode == 0
    proc, _ = start_until_started(scene, "v1")
    proc.send_signal(signal.SIGKILL)  # the laptop vanishes: no cleanup, the TCP connection just dies
    proc.wait()
    ctr = dk.containers.get("eagle-v1")
    assert ctr.status in ("running", "exited") and ctr.wait(timeout=120)["StatusCode"] == 0
    res = ops(scene, "attach", "v1", "--runs-dir", str(scene["runs"]))
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads((scene["runs"] / "box" / "v1" / "summary.json").read_text())["checks"]
    with pytest.raises(Exception):
        dk.containers.get("eagle-v1")  # collected after attach fetched everything


def test_preflight_failures_start_and_stop_nothing(scene, dk, image, tmp_path):
    """A missing image or a non-empty output folder fails preflight with one error line (exit 4): the
    server keeps running, no stage container exists."""
    assert ops(scene, "restore-server").returncode == 0  # an earlier test's run left it stopped
    scene["server"].reload()
    assert scene["server"].status == "running"
    text = scene["hosts"].read_text()
    bad = tmp_path / "hosts.toml"
    assert image[0] in text
    bad.write_text(text.replace(image[0], "eagle-ops-test-missing:0"))
    (scene["data"] / "hidden_states").mkdir(exist_ok=True)
    (scene["data"] / "hidden_states" / "keep").write_text("x")
    for hosts, expect in (
        (bad, "image: image eagle-ops-test-missing:0 is not on box"),
        (scene["hosts"], "output: "),
    ):
        res = run_ops(
            "remote-extract",
            "--run-id",
            "pf",
            "--host",
            "box",
            "--hosts-file",
            str(hosts),
            "--runs-dir",
            str(tmp_path / "runs"),
        )
        assert res.returncode == 4, res.stdout + res.stderr
        assert res.stderr.strip().splitlines() == [res.stderr.strip()] and expect in res.stderr
        scene["server"].reload()
        assert scene["server"].status == "running"
        assert not dk.containers.list(all=True, filters={"label": "eagle-ops.run-id=pf"})


def test_missing_docker_is_one_line_error(tmp_path, devdir):
    """On a host without docker, remote-extract stops at preflight with one error line and exit 4."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "sh", "fuser", "cat", "python3"):
        path = (
            "/usr/bin/python3"
            if tool == "python3"
            else subprocess.run(
                ["bash", "-c", f"command -v {tool}"], capture_output=True, text=True
            ).stdout.strip()
        )
        (bin_dir / tool).symlink_to(path)
    data = tmp_path / "data"
    (data / "prepared").mkdir(parents=True)
    table = write_gpu_table(tmp_path / "gpus.json", [{"processes": []}])
    hosts = write_hosts(
        tmp_path / "hosts.toml",
        "nodocker",
        host="local",
        python="/usr/bin/python3",
        data_root=str(data),
        model_dir=str(tmp_path),
        device_glob=f"{devdir}/nvidia*",
        gpu_source=f"table:{table}",
        lock_file=str(tmp_path / "eagle-ops.lock"),
    )
    env = dict(os.environ, PATH=str(bin_dir))
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "ops",
            "remote-extract",
            "--host",
            "nodocker",
            "--hosts-file",
            str(hosts),
            "--runs-dir",
            str(tmp_path / "runs"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode == 4, res.stdout + res.stderr
    assert res.stderr.strip() == "error: preflight failed: docker: docker is not installed on nodocker"


@pytest.mark.slow
def test_failing_stage_exit_code_is_propagated(scene, extracted):
    """A stage that fails (verify finds a gap in the numbering) makes remote-run exit with the stage's
    own non-zero code; its summary is still fetched and shows the failed check."""
    assert extracted[0].returncode == 0
    hs = scene["data"] / "hidden_states"
    (hs / "keep").unlink(missing_ok=True)
    (hs / "data_9.pt").write_bytes((hs / "data_0.pt").read_bytes())
    try:
        res = ops(scene, "remote-run", "verify", "--run-id", "bad1", "--runs-dir", str(scene["runs"]))
        summary = json.loads((scene["runs"] / "box" / "bad1" / "summary.json").read_text())
        run = json.loads((scene["runs"] / "box" / "bad1" / "run.json").read_text())
        assert res.returncode != 0 and res.returncode == run["exit_code"], res.stdout[-2000:] + res.stderr
        assert any(c["status"] != "ok" for c in summary["checks"])
        assert f"stage exit code {run['exit_code']}" in res.stdout
    finally:
        (hs / "data_9.pt").unlink()


@pytest.mark.slow
def test_ctrl_c_stops_the_stage_and_restores_the_server(scene, extracted, dk):
    """Ctrl-C once the stage runs: the stage container is stopped and removed (its log kept), the server
    is restored (--restore-server), exit code 130, state.json says interrupted."""
    assert extracted[0].returncode == 0
    assert ops(scene, "restore-server").returncode == 0  # running, so that there is something to restore
    proc, lines = start_until_started(scene, "int1", "--restore-server")
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    text = "".join(lines) + rest
    assert proc.returncode == 130, text
    assert "interrupted: stopping container eagle-int1" in text and "restored: start server" in text
    assert not dk.containers.list(all=True, filters={"label": "eagle-ops.run-id=int1"})
    scene["server"].reload()
    assert scene["server"].status == "running"
    state = json.loads((scene["runs"] / "box" / "int1" / "state.json").read_text())
    # "started" is printed at the end of the start step: the Ctrl-C lands there or in follow
    assert (
        state["status"] == "interrupted"
        and state["step"] in ("start", "follow")
        and state["container_removed"]
    )


@pytest.mark.slow
def test_server_side_drop_is_reported_and_attach_recovers(scene, extracted, dk, sshd):
    """The host end of the connection dies mid-follow (sshd's session processes killed): ops says it lost
    the connection (exit 3, the connection's code) instead of hanging, the container is untouched, attach
    finishes the run."""
    assert extracted[0].returncode == 0
    proc, _ = start_until_started(scene, "drop2")
    sessions = subprocess.run(
        ["pgrep", "-P", str(sshd.proc.pid)], capture_output=True, text=True
    ).stdout.split()
    assert sessions
    for pid in sessions:  # only our sshd's per-connection children: this test's connection
        os.kill(int(pid), signal.SIGKILL)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3 and "lost during" in rest, rest
    assert dk.containers.get("eagle-drop2").wait(timeout=120)["StatusCode"] == 0
    res = ops(scene, "attach", "drop2", "--runs-dir", str(scene["runs"]))
    assert res.returncode == 0, res.stdout + res.stderr
