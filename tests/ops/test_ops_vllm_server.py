"""A real `vllm serve` (vLLM 0.32.0 CPU build from .venv-vllm) of the tiny model as the inference server:
stopped by pid file and by container, including after its API process was SIGKILLed and its
VLLM::EngineCore child was left re-parented (the field bug, vllm#55510). Run by `make test-ops-vllm`
with the light venv; .venv-vllm only provides the server program."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline.runtime import vllm_cpu
from ops_docker import client, remove_test_containers, stage_image, unique
from ops_helpers import REPO, run_ops, ssh_table, write_hosts
from ops_procs import alive, wait_for, write_gpu_table
from ops_sshd import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.sshd]

VLLM = REPO / ".venv-vllm" / "bin" / "vllm"
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "PYTHONUNBUFFERED": "1",
}  # 0.32 binds OpenMP threads itself ("auto"; "all" is refused)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    assert VLLM.exists(), f"{VLLM} missing: build the vLLM CPU environment (make env-vllm)"
    from pipeline.demo.tiny import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("vllm-model") / "model")


def serve_argv(vllm: str, model: Path, port: int) -> list[str]:
    return [
        vllm,
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "256",
        "--enforce-eager",
        "--dtype",
        "float32",
        *vllm_cpu.cli_arguments("float32"),  # this CPU's settings (pipeline/runtime/vllm_cpu.py)
    ]


def wait_ready(port: int, proc_alive, log_tail, timeout: float = 400, complete: bool = True) -> None:
    """Until the OpenAI API lists the model and (if `complete`) answers one completion. `log_tail()` is the
    server's last output, shown when it dies during start-up (CI has only this to go on)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc_alive(), "vllm serve exited during start-up; its last output:\n" + log_tail()
        try:
            models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5))
            if not complete:
                return
            body = json.dumps({"model": models["data"][0]["id"], "prompt": "hello", "max_tokens": 4}).encode()
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            reply = json.load(urllib.request.urlopen(req, timeout=60))
            assert reply.get("choices"), reply
            return
        except OSError:
            time.sleep(2)
    raise AssertionError(f"vllm serve not ready within {timeout} s")


def group(pgid: int) -> dict[int, tuple[str, int]]:
    """Live members of a process group: pid -> (comm, ppid)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                rest = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(rest[2]) == pgid and rest[0] not in ("Z", "X"):
                    out[int(entry.name)] = ((entry / "comm").read_text().strip(), int(rest[1]))
            except (OSError, IndexError):
                pass
    return out


def hosts_for(tmp_path, sshd, server: str) -> Path:
    table = write_gpu_table(tmp_path / "gpus.json", [{"processes": []}])
    return write_hosts(
        tmp_path / "hosts.toml",
        "box",
        **ssh_table(
            sshd,
            sshd.write_known_hosts(tmp_path / "known_hosts"),
            server=server,
            gpu_source=f"table:{table}",
            device_glob=f"{tmp_path}/nodev*",
            timeouts={"stop": 30, "kill_wait": 5},
        ),
    )


def test_pidfile_stop_after_api_sigkill_leaves_nothing(tmp_path, sshd, tiny_model):
    """vllm serve's API process is SIGKILLed, its EngineCore lives on re-parented in the process group;
    stop-server by pid file ends every member of the group."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    log = log_path.open("w")
    api = subprocess.Popen(
        serve_argv(str(VLLM), tiny_model, port),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**__import__("os").environ, **ENV},
    )
    try:
        (tmp_path / "vllm.pid").write_text(str(api.pid))
        wait_ready(port, lambda: api.poll() is None, lambda: log_path.read_text()[-4000:])
        engine = [pid for pid, (comm, _) in group(api.pid).items() if comm.startswith("VLLM::EngineCor")]
        assert engine, group(api.pid)
        api.send_signal(signal.SIGKILL)
        api.wait()
        wait_for(lambda: all(ppid != api.pid for _, ppid in group(api.pid).values()))
        assert all(alive(p) for p in engine)  # the field bug: the engine outlives its API process
        res = run_ops(
            "stop-server",
            "--host",
            "box",
            "--hosts-file",
            str(hosts_for(tmp_path, sshd, f"pidfile:{tmp_path / 'vllm.pid'}")),
        )
        assert res.returncode == 0, res.stdout + res.stderr
        assert "VLLM::EngineCor" in res.stdout
        assert group(api.pid) == {}
    finally:
        for pid in group(api.pid):
            __import__("os").kill(pid, signal.SIGKILL)
        if api.poll() is None:
            api.kill()
            api.wait()


@pytest.mark.docker
def test_container_stop_after_api_sigkill_leaves_nothing(tmp_path, sshd, tiny_model):
    """vllm serve in a container; its API process is SIGKILLed and the (paused) engine is left under the
    container's init shell; stop-server by container stops the container and the engine is gone.

    The init shell outlives the server (as entrypoints that keep a container up for debugging do): only
    then can a container hold an orphaned engine. A shell that just runs the server exits with it, and the
    kernel then kills everything in the container's pid namespace (CI stop 26 failed on that race)."""
    dk = client()
    image, mounts = stage_image(dk, REPO, sys.base_prefix)
    name, port = unique("ops-test-vllm"), free_port()
    volumes = {m.split(":")[0]: {"bind": m.split(":")[1], "mode": "ro"} for m in mounts}
    volumes[str(tiny_model)] = {"bind": str(tiny_model), "mode": "ro"}
    # vllm._C needs libnuma, which the minimal test base lacks: lend the host's (same Debian 12)
    volumes["/usr/lib/x86_64-linux-gnu/libnuma.so.1.0.0"] = {
        "bind": "/usr/lib/x86_64-linux-gnu/libnuma.so.1",
        "mode": "ro",
    }
    cmd = " ".join(serve_argv(str(VLLM), tiny_model, port))
    # vLLM 0.32's engine needs 160 MiB of shared memory for its message queue; docker's default /dev/shm
    # is 64 MiB
    init = f"trap 'exit 0' TERM; {cmd}; while :; do sleep 0.2; done"
    ctr = dk.containers.run(
        image,
        ["sh", "-c", init],
        name=name,
        detach=True,
        network_mode="host",
        environment=ENV,
        volumes=volumes,
        labels={"eagle-ops-test": "1"},
        shm_size="512m",
    )
    try:

        def running() -> bool:
            ctr.reload()
            return ctr.status == "running"

        # models listed, no completion: the engine's first step compiles with g++, which the minimal
        # test base image lacks (the engine would die of it, and the point is that it lives on)
        wait_ready(port, running, lambda: ctr.logs(tail=40).decode(errors="replace"), complete=False)
        top = {
            int(p[0]): (int(p[1]), p[-1]) for p in dk.api.top(name, ps_args="-eo pid,ppid,comm")["Processes"]
        }
        api = [pid for pid, (_, comm) in top.items() if comm == "vllm"]
        assert len(api) == 1, top
        # the engine is the API's own child; a short-lived process it forks carries its name until exec, so
        # only the children still alive once paused count (CI once paused such a one, gone by the check)
        engine = [
            pid for pid, (ppid, comm) in top.items() if ppid == api[0] and comm.startswith("VLLM::EngineCor")
        ]
        # the engine is paused first, so that it cannot leave on its own once the API is gone: the point
        # here is what stop-server does with one that does not (the engine death CI saw in stop 26 was
        # instead the pid-namespace kill that the init shell above now prevents)
        for pid in engine:
            __import__("os").kill(pid, signal.SIGSTOP)
        engine = [pid for pid in engine if alive(pid)]
        assert engine, top
        __import__("os").kill(api[0], signal.SIGKILL)
        wait_for(lambda: not alive(api[0]))
        assert running() and all(alive(p) for p in engine), (
            {p: alive(p) for p in engine},
            top,
            ctr.logs(tail=40).decode(errors="replace"),
        )
        res = run_ops(
            "stop-server",
            "--host",
            "box",
            "--hosts-file",
            str(hosts_for(tmp_path, sshd, f"container:{name}")),
        )
        assert res.returncode == 0, res.stdout + res.stderr
        ctr.reload()
        assert ctr.status == "exited" and not any(alive(p) for p in engine)
    finally:
        remove_test_containers(dk, [name])
