"""Server stop/restore strategies with a real dockerd and real process groups, over a real sshd."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from ops_helpers import run_ops, ssh_table, write_hosts
from ops.agent import client_identity
from ops.gpus import ServerFacts
from ops.hosts import HostConfig, Timeouts, parse_strategy
from ops.server import START_WATCH, plan_restore, plan_stop
from ops_docker import client, ensure_base_image, holder_container, remove_test_containers, unique
from ops_procs import HOLDER, alive, wait_for, write_gpu_table

FAST = {"grace": 1, "kill_wait": 2, "stop": 3, "clean": 3}


@pytest.fixture(scope="module")
def dk():
    c = client()
    ensure_base_image()
    return c


@pytest.fixture
def containers(dk):
    names: list[str] = []
    yield names
    remove_test_containers(dk, names)


def hosts_for(tmp_path, sshd, devdir, server, table=None, **extra):
    known = sshd.write_known_hosts(tmp_path / "known_hosts")
    table = table or write_gpu_table(tmp_path / "gpus.json", [{"processes": []}])
    return write_hosts(
        tmp_path / "hosts.toml",
        "box",
        **ssh_table(
            sshd,
            known,
            server=server,
            device_glob=f"{devdir}/nvidia*",
            gpu_source=f"table:{table}",
            timeouts=FAST,
            **extra,
        ),
    )


def ops(hosts, *args):
    return run_ops(*args, "--host", "box", "--hosts-file", str(hosts))


# ---- plans (exact argv) -------------------------------------------------------------------------------


def _host(strategy: str, **kw) -> HostConfig:
    return HostConfig(name="h", host="h", server=parse_strategy(strategy), timeouts=Timeouts(stop=42), **kw)


def test_stop_and_restore_plans_are_exact_argv():
    """Each strategy's stop and restore are the exact commands documented, and nothing when not running."""
    running = ServerFacts("container", container_ids=("c1",), running_container_ids=("c1",))
    assert plan_stop(_host("container:vllm"), running).steps[0].argv == (
        "docker",
        "stop",
        "--time",
        "42",
        "vllm",
    )
    assert plan_restore(_host("container:vllm"), ServerFacts("container", ("c1",)))[0].argv == (
        "docker",
        "start",
        "vllm",
    )
    compose = ServerFacts("compose", container_ids=("a1", "b2"), running_container_ids=("a1", "b2"))
    assert plan_stop(_host("compose:inf/vllm"), compose).steps[0].argv == (
        "docker",
        "stop",
        "--time",
        "42",
        "a1",
        "b2",
    )
    assert plan_restore(_host("compose:inf/vllm"), ServerFacts("compose", ("a1", "b2")))[0].argv == (
        "docker",
        "start",
        "a1",
        "b2",
    )
    unit = ServerFacts("systemd", members=(10, 11))
    assert plan_stop(_host("systemd:vllm.service"), unit).steps[0].argv == (
        "systemctl",
        "stop",
        "vllm.service",
    )
    assert plan_restore(_host("systemd:vllm.service"), ServerFacts("systemd"))[0].argv == (
        "systemctl",
        "start",
        "vllm.service",
    )
    group = ServerFacts("pidfile", pgid=77, members=(77, 78))
    step = plan_stop(_host("pidfile:/run/v.pid"), group).steps[0]
    assert step.agent == {
        "op": "terminate",
        "targets": [],
        "groups": [77],
        "grace": 42,
        "kill_wait": 5.0,
        "client": client_identity(),
        "spare_ssh_session": True,
    }  # ops' own processes on the host are never signalled
    start = plan_restore(
        _host("pidfile:/run/v.pid", server_start=("/opt/v/serve.sh", "a b")), ServerFacts("pidfile")
    )
    assert start[0].argv == ("sh", "-c", START_WATCH, "sh", "/opt/v/serve.sh", "a b")
    assert plan_stop(_host("container:vllm"), ServerFacts("container", ("c1",))).steps == ()
    assert plan_stop(_host("none"), ServerFacts("none")).steps == ()


# ---- real containers ----------------------------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.sshd
def test_container_strategy_stop_clean_restore(tmp_path, sshd, dk, containers, devdir, procs):
    """A named container holding the GPU is the 'server': gpu-clean stops it with docker stop (orphan
    killed too), nothing of it runs after, and restore-server starts it again."""
    name = unique("ops-test-vllm")
    containers.append(name)
    ctr = holder_container(dk, name, devdir, [devdir / "nvidia0", devdir / "nvidiactl"])
    host_pid = ctr.attrs["State"]["Pid"]
    orphan = procs.holder([devdir / "nvidia0"], name="orphan")
    table = write_gpu_table(
        tmp_path / "gpus.json",
        [{"processes": [{"pid": host_pid, "used_mib": 5000}, {"pid": orphan.pid, "used_mib": 100}]}],
    )
    hosts = hosts_for(tmp_path, sshd, devdir, f"container:{name}", table)
    status = json.loads(ops(hosts, "gpu-status", "--json").stdout)
    server_holder = next(h for h in status["holders"] if h["proc"]["pid"] == host_pid)
    assert server_holder["klass"] == "server" and server_holder["proc"]["container"] == name
    res = ops(hosts, "gpu-clean")
    assert res.returncode == 0, res.stdout + res.stderr
    ctr.reload()
    assert ctr.status == "exited" and not alive(host_pid) and not alive(orphan.pid)
    assert f"stopped server container:{name}: {name}" in res.stdout
    res = ops(hosts, "restore-server")
    assert res.returncode == 0, res.stderr
    ctr.reload()
    assert ctr.status == "running"
    assert ops(hosts, "restore-server").stdout.strip().endswith("already running or strategy none")


@pytest.mark.docker
@pytest.mark.sshd
def test_compose_strategy_finds_the_service_by_labels(tmp_path, sshd, dk, containers, devdir):
    """compose:PROJECT/SERVICE stops exactly the containers carrying compose's labels for that service."""
    project = unique("inf")
    svc, other = unique("ops-test-svc"), unique("ops-test-other")
    containers += [svc, other]
    labels = {"com.docker.compose.project": project, "com.docker.compose.service": "vllm"}
    a = holder_container(dk, svc, devdir, [devdir / "nvidia0"], labels=labels)
    b = holder_container(
        dk,
        other,
        devdir,
        [devdir / "nvidiactl"],
        labels={"com.docker.compose.project": project, "com.docker.compose.service": "proxy"},
    )
    hosts = hosts_for(tmp_path, sshd, devdir, f"compose:{project}/vllm")
    res = ops(hosts, "stop-server")
    assert res.returncode == 0, res.stdout + res.stderr
    a.reload(), b.reload()
    assert (a.status, b.status) == ("exited", "running")
    assert ops(hosts, "restore-server").returncode == 0
    a.reload()
    assert a.status == "running"


# ---- pid file: the vLLM field bug ---------------------------------------------------------------------


@pytest.mark.sshd
def test_pidfile_stop_catches_reparented_engine_after_api_sigkill(tmp_path, sshd, devdir, procs):
    """After the API process is SIGKILLed its engine child lives on, re-parented, in the server's process
    group; stop-server by pid file still ends it, and nothing of the group is alive after."""
    pidfile = tmp_path / "vllm.pid"
    api, engine = procs.server(pidfile, [devdir / "nvidia0"])
    api.send_signal(signal.SIGKILL)
    api.wait()
    wait_for(lambda: _ppid(engine) != api.pid)
    assert alive(engine) and os.getpgid(engine) == api.pid
    hosts = hosts_for(tmp_path, sshd, devdir, f"pidfile:{pidfile}")
    res = ops(hosts, "stop-server")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"pid {engine} (VLLM::EngineCor)" in res.stdout
    assert not alive(engine)
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == api.pid and alive(int(p))]


@pytest.mark.sshd
def test_pidfile_restore_runs_the_start_command_detached(tmp_path, sshd, devdir, procs):
    """restore-server runs server_start detached (it outlives the SSH session); stop-server ends it again."""
    pidfile = tmp_path / "srv.pid"
    script = tmp_path / "serve.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {HOLDER!r}, 'VLLM::EngineCore', '0', "
        f"{str(devdir / 'nvidia0')!r}],"
        " stdout=subprocess.DEVNULL)\n"
        f"open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
        "child.wait()\n"
    )
    hosts = hosts_for(
        tmp_path, sshd, devdir, f"pidfile:{pidfile}", server_start=[sys.executable, str(script)]
    )
    res = ops(hosts, "restore-server")
    assert res.returncode == 0, res.stdout + res.stderr
    wait_for(pidfile.exists)
    leader = int(pidfile.read_text())
    procs.extra_pids.append(leader)
    assert alive(leader) and os.getpgid(leader) == leader
    res = ops(hosts, "stop-server")
    assert res.returncode == 0, res.stdout + res.stderr
    assert not alive(leader)


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _pgid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


@pytest.mark.sshd
def test_stale_pidfile_with_reused_pid_kills_nothing(tmp_path, sshd, devdir, procs):
    """A pid file older than the process now holding its pid (pid reused) is not the server: stop-server
    leaves that process and its group alone."""
    bystander = procs.holder([devdir / "nvidia0"], name="bystander", start_new_session=True)
    pidfile = tmp_path / "old.pid"
    pidfile.write_text(str(bystander.pid))
    os.utime(pidfile, (1, 1))  # written long before the bystander started
    hosts = hosts_for(tmp_path, sshd, devdir, f"pidfile:{pidfile}")
    res = ops(hosts, "stop-server")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "not running, nothing to stop" in res.stdout
    assert bystander.poll() is None
