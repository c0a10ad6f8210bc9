"""The server-up stage (regenerate) and evaluate through ops: the plans follow the stage table's `server`
field (regenerate: no stop, no gpu-clean, no restore, no GPUs, the host's network, the hosts file's endpoint
and model; evaluate: GPUs, server stopped and restored), and a real `remote-regenerate` against the
rehearsal host (the session's real sshd, the real dockerd, the test stage image) whose inference server is a
real OpenAI-compatible HTTP server on the host's loopback (tests/pipeline/fake_openai.py's FakeServer in a
process of its own, run by a pid file, holding the host's stand-in GPU): it answers every row, runs through
and after the run with the same pid, and a server that is down, serves another model or has no chat
template is refused before anything runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from ops.hosts import HostConfig
from ops.stage import plan_stage
from ops_docker import client, stage_image
from ops_helpers import REPO, loopback_hosts, run_ops, write_hosts
from ops_procs import alive, wait_for, write_gpu_table

FAST = {"grace": 1, "kill_wait": 2, "stop": 3, "clean": 3}
PRIVILEGES = ("--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--read-only", "--ipc", "private")


def _has(argv, words) -> bool:
    """Whether ``words`` appear in ``argv`` as consecutive words."""
    n = len(words)
    return any(tuple(argv[i : i + n]) == tuple(words) for i in range(len(argv) - n + 1))


# ------------------------------------------------------------------ plans (pure) and --dry-run


def test_regenerate_plan_asks_the_running_server_and_evaluate_frees_the_gpus():
    """regenerate: the hosts file's endpoint and model as flags, the host's network (stage and preflight
    container), no GPUs, no model mount, every other privilege flag kept, and its preflight is the stage's
    own `--check`; an endpoint or model given after `--` wins. evaluate: GPUs, the bridge network, the
    trained draft and held-out prompts as inputs, `check-args` as preflight."""
    host = HostConfig(
        name="box",
        host="box",
        data_root="/srv/d",
        server_endpoint="http://127.0.0.1:8123/v1",
        served_model="kimi-k2.5",
    )
    plan = plan_stage(host, "regenerate", run_id="r1", extra_args=("--concurrency", "4"))
    assert plan.server_up
    assert plan.stage_argv == (
        "python",
        "-m",
        "pipeline",
        "regenerate",
        "--data",
        "/data/conversations.jsonl",
        "--out",
        "/data/regenerated",
        "--endpoint",
        "http://127.0.0.1:8123/v1",
        "--served-model",
        "kimi-k2.5",
        "--concurrency",
        "4",
    )
    assert plan.host_inputs == ("/srv/d/conversations.jsonl",) and plan.host_output == "/srv/d/regenerated"
    for argv in (plan.docker_run, plan.preflight_run):
        assert _has(argv, ("--network", "host")) and "--gpus" not in argv
        assert all(w in argv for w in PRIVILEGES) and "--privileged" not in argv
        assert not any("target=/model" in w for w in argv)
    assert plan.preflight_run[-1].endswith("--served-model kimi-k2.5 --concurrency 4 --check")
    assert plan.preflight_run[-1].startswith("python -m pipeline regenerate ")
    mine = plan_stage(host, "regenerate", run_id="r2", extra_args=("--endpoint=http://10.0.0.5:8000/v1",))
    assert "http://127.0.0.1:8123/v1" not in mine.stage_argv and mine.stage_argv[-3:] == (
        "--served-model",
        "kimi-k2.5",
        "--endpoint=http://10.0.0.5:8000/v1",
    )
    plain = plan_stage(HostConfig(name="box", host="box"), "regenerate", run_id="r3")
    assert plain.stage_argv[-2:] == ("--endpoint", "http://127.0.0.1:8000/v1")  # no model: the one it lists

    ev = plan_stage(host, "evaluate", run_id="e1")
    assert not ev.server_up and _has(ev.docker_run, ("--gpus", "all")) and "--network" not in ev.docker_run
    assert ev.host_inputs == ("/srv/d/train", "/srv/d/prompts.jsonl") and ev.host_output == "/srv/d/evaluate"
    assert ev.stage_argv[3:] == (
        "evaluate",
        "--model",
        "/model",
        "--draft",
        "/data/train",
        "--prompts",
        "/data/prompts.jsonl",
        "--out",
        "/data/evaluate",
    )
    assert ev.preflight_run[-1].startswith("python -m pipeline check-args evaluate ")
    for stage in ("prepare", "extract", "weights", "train", "verify"):  # unchanged: the bridge, no endpoint
        other = plan_stage(host, stage, run_id="o1")
        assert not other.server_up and "--network" not in other.docker_run
        assert "--endpoint" not in other.stage_argv
        # prepare and weights need no GPU and no server: left as it is; the others free the GPUs
        assert other.stops_server == (stage not in ("prepare", "weights")), stage
    assert not plan.stops_server and ev.stops_server


def test_dry_runs_say_what_happens_to_the_server(tmp_path):
    """`remote-regenerate --dry-run` says the server stays up (no stop, no gpu-clean, nothing to restore)
    and shows the hosts file's endpoint and model in the argv with `--network host`; `remote-run evaluate
    --dry-run` says the server is stopped, the GPUs freed, restored with --restore-server."""
    hosts = write_hosts(
        tmp_path / "hosts.toml",
        "box",
        host="box.example",
        server="container:vllm",
        server_endpoint="http://127.0.0.1:8123/v1",
        served_model="kimi-k2.5",
    )
    res = run_ops("remote-regenerate", "--host", "box", "--hosts-file", str(hosts), "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "server container:vllm: stays up: never stopped, no gpu-clean, nothing to restore" in res.stdout
    run_line = next(ln for ln in res.stdout.splitlines() if ln.strip().startswith("docker run"))
    assert "--network host" in run_line and "--gpus" not in run_line
    assert "--endpoint http://127.0.0.1:8123/v1 --served-model kimi-k2.5'" in run_line
    assert "regenerate --data /data/conversations.jsonl" in res.stdout and "--check" in res.stdout
    res = run_ops("remote-run", "evaluate", "--host", "box", "--hosts-file", str(hosts), "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "server container:vllm: stopped and the GPUs freed and proven clean (gpu-clean)" in res.stdout
    assert "restored at the end with --restore-server" in res.stdout
    run_line = next(ln for ln in res.stdout.splitlines() if ln.strip().startswith("docker run"))
    assert "--gpus all" in run_line and "--network" not in run_line
    res = run_ops("remote-run", "prepare", "--host", "box", "--hosts-file", str(hosts), "--dry-run")
    assert res.returncode == 0, res.stderr
    assert (
        "server container:vllm: left as it is: never stopped, no gpu-clean, nothing to restore" in res.stdout
    )


@pytest.mark.parametrize(
    "key,value,text",
    [
        ("server_endpoint", "127.0.0.1:8000", "server_endpoint must be an http(s) URL"),
        ("server_endpoint", "http://user:secret@box:8000/v1", "server_endpoint must be an http(s) URL"),
        ("served_model", "two words", "served_model must be the server's model name"),
        ("served_model", 7, "served_model must be the server's model name"),
    ],
)
def test_bad_server_keys_are_one_line_before_anything(tmp_path, key, value, text):
    hosts = write_hosts(tmp_path / "hosts.toml", "box", host="box.example", **{key: value})
    res = run_ops("remote-regenerate", "--host", "box", "--hosts-file", str(hosts), "--dry-run")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [res.stderr.strip()] and text in res.stderr


# ------------------------------------------------------------------ a real remote-regenerate

# The host's "inference server": a real OpenAI-compatible HTTP server (FakeServer) on the host's loopback,
# in a session of its own with a pid file (strategy pidfile:), holding the host's one stand-in GPU.
SERVER = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
from tests.pipeline.fake_openai import FakeServer
pidfile, device, model, mode = sys.argv[2:6]
held = open(device, "rb")
def no_template(body):
    return 400, b'{"error": {"message": "the tokenizer does not define a chat template"}}'
kw = {"reply": no_template} if mode == "no-template" else {}
server = FakeServer(models=(model,), **kw)
tmp = pidfile + ".tmp"
open(tmp, "w").write(str(os.getpid()))
os.rename(tmp, pidfile)
print(server.port, flush=True)
while True:
    time.sleep(1)
"""


class HostServer:
    """The server process: its pid, its port, and how many chat requests it has answered (by asking it)."""

    def __init__(self, folder: Path, device: Path, model: str = "fake", mode: str = "") -> None:
        self.pidfile = folder / f"server-{model}{mode}.pid"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(REPO), str(self.pidfile), str(device), model, mode],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.port = int(self.proc.stdout.readline())
        wait_for(self.pidfile.exists)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def models(self) -> list[str]:
        with urllib.request.urlopen(self.url + "/models", timeout=5) as resp:
            return [m["id"] for m in json.load(resp)["data"]]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def regen_host(tmp_path, sshd):
    """The rehearsal host with its server up: data root with 5 conversations, the server holding GPU 0 in
    the GPU table, the hosts file `box` (strategy pidfile, server_endpoint and served_model of it)."""
    dk = client()
    image, mounts = stage_image(dk, REPO, sys.base_prefix)
    devdir = tmp_path / "dev"
    devdir.mkdir()
    (devdir / "nvidia0").write_bytes(b"")
    server = HostServer(tmp_path, devdir / "nvidia0")
    table = write_gpu_table(
        tmp_path / "gpus.json", [{"processes": [{"pid": server.proc.pid, "used_mib": 9000}]}]
    )
    data = tmp_path / "data"
    (data / "cache").mkdir(parents=True)
    rows = [
        {
            "id": f"r{i}",
            "messages": [
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": f"someone else's answer {i}"},
            ],
        }
        for i in range(5)
    ]
    (data / "conversations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def hosts(name: str = "hosts.toml", model: Path | None = None, **over) -> Path:
        strategy = over.pop("server", f"pidfile:{server.pidfile}")
        over = {"server_endpoint": server.url, "served_model": "fake", **over}
        return loopback_hosts(
            tmp_path / name, "box", sshd, strategy, devdir, table, (image, mounts), data, model, FAST, **over
        )

    yield dict(dk=dk, server=server, data=data, hosts=hosts, runs=tmp_path / "runs", devdir=devdir)
    for ctr in dk.containers.list(all=True, filters={"label": "eagle-ops.host=box"}):
        if ctr.labels.get("eagle-ops.output", "").startswith(f"{data}/"):
            ctr.remove(force=True)
    server.stop()
    subprocess.run(["rm", "-rf", "--", str(data)], check=False)  # files the stage's user wrote


def _remote_regenerate(host, hosts: Path, run_id: str, *extra: str):
    return run_ops(
        "remote-regenerate",
        "--host",
        "box",
        "--hosts-file",
        str(hosts),
        "--run-id",
        run_id,
        "--runs-dir",
        str(host["runs"]),
        *extra,
        timeout=300,
    )


def _steps(host, run_id: str) -> list[str]:
    state = json.loads((host["runs"] / "box" / run_id / "state.json").read_text())
    return [s["step"] for s in state["steps"]]


@pytest.mark.slow
@pytest.mark.sshd
@pytest.mark.docker
def test_remote_regenerate_asks_the_running_server_and_never_stops_it(regen_host):
    """The whole run against the host's live server: every row answered by it, the output prepare reads,
    the summary fetched, and the server process (same pid, same start) answering through and after the
    run; the run's steps have no stop-server, clean or restore (--restore-server given: nothing to do), and
    its container had the host's network and no GPU."""
    host = regen_host
    server = host["server"]
    started = Path(f"/proc/{server.proc.pid}/stat").read_text().split()[21]
    res = _remote_regenerate(host, host["hosts"](), "g1", "--restore-server", "--", "--concurrency", "2")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    assert "kept running: regenerate asks it; no gpu-clean" in res.stdout
    assert "regenerated 5 of 5 rows (0 rejected)" in res.stdout
    steps = _steps(host, "g1")
    assert steps[:3] == ["connect", "lock", "preflight"] and "start" in steps and "fetch" in steps
    assert not {"stop-server", "clean", "restore"} & set(steps)
    out = [
        json.loads(ln)
        for ln in (host["data"] / "regenerated" / "conversations.jsonl").read_text().split("\n")
        if ln
    ]
    assert [r["id"] for r in out] == [f"r{i}" for i in range(5)]
    assert all(
        r["messages"][-1]["content"] == f"answer to 'question {i}' after 1 turns" for i, r in enumerate(out)
    )
    local = host["runs"] / "box" / "g1"
    summary = json.loads((local / "summary.json").read_text())
    assert summary["kept"] == 5 and summary["served_model"] == "fake" and summary["endpoint"] == server.url
    run = json.loads((local / "run.json").read_text())
    assert run["server"] == "up" and run["exit_code"] == 0 and run["restored"] == []
    argv = run["docker_run"]
    assert _has(argv, ("--network", "host")) and "--gpus" not in argv and _has(argv, ("--cap-drop", "ALL"))
    # the host's look at the strategy, then the image's ask of the endpoint; and --check's input, output
    assert [c["status"] for c in run["checks"] if c["name"] == "server"] == ["ok", "ok"]
    assert {"input", "output"} <= {c["name"] for c in run["checks"]}
    assert server.proc.poll() is None and alive(server.proc.pid)
    assert Path(f"/proc/{server.proc.pid}/stat").read_text().split()[21] == started
    assert server.models() == ["fake"]  # still answering


@pytest.mark.slow
@pytest.mark.sshd
@pytest.mark.docker
def test_prepare_and_weights_leave_the_live_server_alone(regen_host, tiny_llama):
    """prepare and weights need no GPU and no server: the host's server (same pid, same start) serves through
    both runs, neither has a stop-server, clean or restore step (--restore-server given: nothing to do), and
    both outputs land."""
    host = regen_host
    server = host["server"]
    started = Path(f"/proc/{server.proc.pid}/stat").read_text().split()[21]
    hosts = host["hosts"]("hosts-model.toml", model=tiny_llama)
    for stage, run_id in (("prepare", "p1"), ("weights", "w1")):
        res = run_ops(
            "remote-run", stage, "--host", "box", "--hosts-file", str(hosts), "--run-id", run_id,
            "--runs-dir", str(host["runs"]), "--restore-server", timeout=300,
        )  # fmt: skip
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr
        assert f"kept running: {stage} needs no GPU; no gpu-clean" in res.stdout
        assert not {"stop-server", "clean", "restore"} & set(_steps(host, run_id)), _steps(host, run_id)
        run = json.loads((host["runs"] / "box" / run_id / "run.json").read_text())
        assert run["server"] == "kept" and run["exit_code"] == 0 and "--gpus" not in run["docker_run"]
    assert (host["data"] / "prepared" / "metadata.json").is_file()
    assert (host["data"] / "verifier" / "verifier.safetensors").is_file()
    assert (
        server.proc.poll() is None
        and Path(f"/proc/{server.proc.pid}/stat").read_text().split()[21] == started
    )
    assert server.models() == ["fake"]  # still answering


@pytest.mark.slow
@pytest.mark.sshd
@pytest.mark.docker
def test_a_server_down_of_another_model_or_without_a_chat_template_is_refused_before_anything(
    regen_host, tmp_path
):
    """Refusals before anything runs, each exit 4 with one line naming the check: the hosts file's endpoint
    where nothing listens, a served_model the server does not serve, a server without a chat template (the
    check in the image), and a server whose pid file names no running process (the host check). No stage
    container, no output folder, the server's process untouched."""
    host = regen_host
    server = host["server"]
    closed = HostServer(tmp_path, host["devdir"] / "nvidia0", model="gone")
    down_url = closed.url
    closed.stop()
    bare = HostServer(tmp_path, host["devdir"] / "nvidia0", mode="no-template")
    try:
        cases = [
            (
                host["hosts"]("down.toml", server_endpoint=down_url),
                "preflight failed: server: no server answers at",
            ),
            (host["hosts"]("other.toml", served_model="other"), "preflight failed: server: " + server.url),
            (host["hosts"]("bare.toml", server_endpoint=bare.url), "cannot render a chat for 'fake'"),
            (
                host["hosts"]("stopped.toml", server=f"pidfile:{tmp_path / 'none.pid'}"),
                "preflight failed: server: server pidfile:",
            ),
        ]
        for i, (hosts, text) in enumerate(cases):
            res = _remote_regenerate(host, hosts, f"bad{i}")
            assert res.returncode == 4, (hosts.name, res.stdout[-3000:], res.stderr)
            lines = res.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], (
                hosts.name,
                lines,
            )
            if hosts.name == "other.toml":
                assert "serves ['fake'], not 'other'" in lines[0]
            assert not host["dk"].containers.list(all=True, filters={"label": f"eagle-ops.run-id=bad{i}"})
            assert not (host["data"] / "regenerated").exists()
            state = json.loads((host["runs"] / "box" / f"bad{i}" / "state.json").read_text())
            assert state["status"] == "failed" and state["steps"][-1]["step"] == "preflight"
            assert server.proc.poll() is None and server.models() == ["fake"]
    finally:
        bare.stop()
