"""remote-extract / remote-run / attach end to end: real sshd, real dockerd, a real pipeline stage on
real files in the stage container, the server container stopped and restored, one SSH connection."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
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


@pytest.fixture
def train_host(scene, warm_pipeline, tmp_path):
    """The scene's host with a train table (hybrid, the producer on GPU 0, the trainer on GPU 1) and a GPU
    table of two GPUs (the server on GPU 0); the verifier weights and a prepared set with a draft vocab
    (`--prepared /data/prepared-draft` after `--`) that the train stage reads."""
    data, env = scene["data"], {"PYTHONDONTWRITEBYTECODE": "1"}
    model = next(line for line in scene["hosts"].read_text().splitlines() if line.startswith("model_dir"))
    model = json.loads(model.split("=", 1)[1])
    warm_pipeline("weights", "--model", model, "--out", data / "verifier", "--overwrite", check=True, env=env)
    warm_pipeline(
        "prepare",
        *("--data", data.parent / "assets" / "conversations.jsonl", "--model", model),
        *("--out", data / "prepared-draft", "--draft-vocab-size", 1024, "--overwrite"),
        check=True,
        env=env,
    )
    server = {"pid": scene["server"].attrs["State"]["Pid"], "used_mib": 9000}
    table = write_gpu_table(tmp_path / "gpus.json", [{"processes": [server]}, {"processes": []}])
    text = scene["hosts"].read_text()
    old = next(line for line in text.splitlines() if line.startswith("gpu_source"))
    hosts = tmp_path / "hosts.toml"
    train = '\n[hosts.box.train]\nstates_mode = "hybrid"\nstates_budget = "50M"\n'
    hosts.write_text(text.replace(old, f'gpu_source = "table:{table}"') + train + "producer_gpus = [0]\n")
    yield dict(hosts=hosts, table=table, server=server, tmp=tmp_path)
    for name in ("verifier", "prepared-draft", "train", "train_states"):
        subprocess.run(["rm", "-rf", "--", str(data / name)], check=True)


def _train_ops(train_host, *args, hosts=None, extra=(), **kw):
    where = ("--host", "box", "--hosts-file", str(hosts or train_host["hosts"]))
    return run_ops(*args, *where, *(("--", *extra) if extra else ()), **kw)


@pytest.mark.slow
def test_remote_train_with_produced_states(scene, train_host, dk):
    """remote-train with the hosts file's train table through sshd and docker: a split naming a GPU the host
    lacks fails the preflight (exit 4, the server untouched); the real run stops the server, starts one
    labelled container whose environment carries the split, every process of the mode runs inside it,
    gpu-clean refuses to kill its GPU holder while it runs, and `attach --restore-server` collects the
    trained draft, the hybrid states dir and the server."""
    runs, hosts = str(train_host["tmp"] / "runs"), train_host["hosts"]
    assert ops(scene, "restore-server").returncode == 0  # an earlier test may have left it stopped
    scene["server"].reload()
    started = scene["server"].attrs["State"]["StartedAt"]
    missing = train_host["tmp"] / "bad.toml"
    missing.write_text(hosts.read_text() + "trainer_gpus = [2]\n")
    res = _train_ops(train_host, "remote-train", "--run-id", "tr0", "--runs-dir", runs, hosts=missing)
    assert res.returncode == 4, res.stdout[-3000:] + res.stderr
    why = "gpu split: train.producer_gpus/trainer_gpus name GPU 2, the host has 2 (0..1)"
    assert res.stderr.strip() == f"error: preflight failed: {why}"
    scene["server"].reload()
    assert scene["server"].status == "running" and scene["server"].attrs["State"]["StartedAt"] == started
    assert not dk.containers.list(all=True, filters={"label": "eagle-ops.run-id=tr0"})

    hosts.write_text(hosts.read_text() + "trainer_gpus = [1]\n")
    cpu = ("--device", "cpu", "--states-device", "cpu", "--prepared", "/data/prepared-draft")
    extra = (*cpu, "--epochs", "2", "--max-len", "64", "--no-plots", "--no-eval")
    res = _train_ops(
        train_host, "remote-train", "--run-id", "tr1", "--runs-dir", runs, "--detach", extra=extra
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    assert "CUDA_VISIBLE_DEVICES=0,1 in PCI bus order" in res.stdout  # the preflight's `gpu split` line
    ctr = dk.containers.get("eagle-tr1")
    assert ctr.labels["eagle-ops.run-id"] == "tr1" and ctr.labels["eagle-ops.stage"] == "train"
    env = dict(e.split("=", 1) for e in ctr.attrs["Config"]["Env"])
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    scene["server"].reload()
    assert scene["server"].status == "exited"  # stopped for the stage, as for extract

    def stage_pids() -> set[int]:  # every process on this machine that runs the mode's command
        out = subprocess.run(["pgrep", "-f", "pipeline train --data /data/train_states"], capture_output=True)
        return {int(p) for p in out.stdout.split()}

    deadline = time.monotonic() + 120
    while not stage_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = stage_pids()
    assert pids, "the stage's train process never appeared"
    for pid in pids:  # each in the stage container's cgroup: what gpu-clean reads to know it is ours
        assert ctr.id in Path(f"/proc/{pid}/cgroup").read_text(), pid
    # `sh -c` is the container's first process, `python -m pipeline train` its child
    (trainer,) = [p for p in pids if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"python\0")]
    # Held stopped while gpu-clean looks at it: it stays the GPU holder however short its run (2 epochs, not
    # 40 to outlast gpu-clean). A SIGTERM from gpu-clean would wait for SIGCONT and then end the run, which
    # the attach below would report; a SIGKILL would end it at once, which alive() below sees.
    os.kill(trainer, signal.SIGSTOP)
    write_gpu_table(
        train_host["table"],
        [{"processes": [train_host["server"]]}, {"processes": [{"pid": trainer, "used_mib": 5000}]}],
    )
    clean = _train_ops(train_host, "gpu-clean")
    assert clean.returncode == 9, clean.stdout + clean.stderr
    assert "stage run tr1 (container eagle-tr1) holds GPUs on box" in clean.stderr
    ctr.reload()
    assert ctr.status == "running" and alive(trainer)  # nothing was signalled
    os.kill(trainer, signal.SIGCONT)

    res = _train_ops(train_host, "attach", "tr1", "--runs-dir", runs, "--restore-server", timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    local = Path(runs) / "box" / "tr1"
    summary = json.loads((local / "summary.json").read_text())
    states = summary["train"]["states"]
    assert summary["complete"] and summary["epochs"] == 2 and states["mode"] == "hybrid"
    assert states["budget_bytes"] == 50_000_000 and 0 < states["peak_bytes"] <= 50_000_000
    assert "OK (0 failed checks)" in (local / "stage.log").read_text()  # `pipeline verify` of the draft
    config = json.loads((scene["data"] / "train_states" / "data_config.json").read_text())
    assert config["extra"]["states"]["mode"] == "hybrid"
    assert (scene["data"] / "train" / "draft").is_dir()
    scene["server"].reload()
    assert scene["server"].status == "running"
    run = json.loads((Path(runs) / "box" / "tr1" / "run.json").read_text())
    assert run["train"]["producer_gpus"] == [0] and run["train"]["trainer_gpus"] == [1]


@pytest.mark.slow
def test_remote_train_over_several_trainer_gpus_is_a_torchrun_job(scene, train_host, dk):
    """trainer_gpus [1, 2] beside the hf producer on GPU 0 (a host of three GPUs): remote-train runs the stage
    as a torchrun job of two `pipeline train` processes in the one container (on the CPU here: gloo, as
    `--device cpu` after `--` asks), the trainer GPUs first in its CUDA_VISIBLE_DEVICES; both ranks train
    and the run completes with the hybrid states dir verified, the server restored."""
    runs, hosts = str(train_host["tmp"] / "runs"), train_host["hosts"]
    assert ops(scene, "restore-server").returncode == 0  # an earlier test may have left it stopped
    write_gpu_table(
        train_host["table"], [{"processes": [train_host["server"]]}, {"processes": []}, {"processes": []}]
    )
    hosts.write_text(hosts.read_text() + "trainer_gpus = [1, 2]\n")
    cpu = ("--device", "cpu", "--states-device", "cpu", "--prepared", "/data/prepared-draft")
    extra = (*cpu, "--epochs", "2", "--max-len", "64", "--no-plots", "--no-eval")
    # the default held-out share leaves one sample for two ranks: each rank refuses in one line, and the
    # job's report is those lines and their exit code, not torchrun's many-line ChildFailedError traceback
    res = _train_ops(
        train_host, "remote-train", "--run-id", "tr3", "--runs-dir", runs, extra=extra, timeout=600
    )
    assert res.returncode != 0
    out = res.stdout + res.stderr
    assert "error: 1 held-out samples for 2 processes: raise --eval-fraction" in out, out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    extra = (*extra, "--eval-fraction", "0.4")
    res = _train_ops(
        train_host, "remote-train", "--run-id", "tr2", "--runs-dir", runs, "--detach", extra=extra
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    assert "data parallel over host GPUs 1, 2 (cuda:0..1: torchrun" in res.stdout  # the `gpu split` line
    ctr = dk.containers.get("eagle-tr2")
    env = dict(e.split("=", 1) for e in ctr.attrs["Config"]["Env"])
    assert env["CUDA_VISIBLE_DEVICES"] == "1,2,0"
    res = _train_ops(train_host, "attach", "tr2", "--runs-dir", runs, "--restore-server", timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    local = Path(runs) / "box" / "tr2"
    log = (local / "stage.log").read_text()
    assert "on cpu x2" in log and "OK (0 failed checks)" in log  # two ranks; `pipeline verify` of the draft
    summary = json.loads((local / "summary.json").read_text())
    assert summary["complete"] and summary["train"]["world_size"] == 2
    assert summary["train"]["states"]["mode"] == "hybrid"
    assert 0 < summary["train"]["states"]["peak_bytes"] <= 50_000_000
    scene["server"].reload()
    assert scene["server"].status == "running"
