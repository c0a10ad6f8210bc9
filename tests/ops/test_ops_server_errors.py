"""Server stop and restore failures with real processes, a real dockerd and a real sshd: one error line,
exit 7 (stop) or 8 (restore), and no GPU holder signalled when the stop failed."""

from __future__ import annotations

import os

import pytest

from ops_docker import client, ensure_base_image, remove_test_containers, unique
from ops_helpers import run_ops, ssh_table, write_hosts
from ops_procs import Freezer, alive, write_gpu_table

pytestmark = pytest.mark.sshd

FAST = {"grace": 1, "kill_wait": 2, "stop": 3, "clean": 3}


@pytest.fixture
def host(tmp_path, sshd, devdir, procs):
    """Hosts files for a given server strategy over the test sshd, with an orphan GPU holder."""
    orphan = procs.holder([devdir / "nvidia1"], name="orphan")
    table = write_gpu_table(tmp_path / "gpus.json", [{"processes": [{"pid": orphan.pid, "used_mib": 10}]}])
    known = sshd.write_known_hosts(tmp_path / "known_hosts")

    def hosts(server: str, **extra):
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

    return dict(hosts=hosts, orphan=orphan)


def ops(hosts, *args):
    return run_ops(*args, "--host", "box", "--hosts-file", str(hosts))


def one_line(res) -> str:
    line = res.stderr.strip()
    assert line.splitlines() == [line] and line.startswith("error: "), res.stdout + res.stderr
    return line


@pytest.mark.docker
def test_missing_server_container_stops_nothing(host):
    """A server container name that does not exist (a typo) is exit 7 naming it, for gpu-clean, its dry
    run and stop-server; the orphan holder is not signalled; restore-server of it is exit 8."""
    client()
    name = unique("ops-test-no-such-server")
    hosts = host["hosts"](f"container:{name}")
    for args in (("gpu-clean",), ("gpu-clean", "--dry-run"), ("stop-server",)):
        res = ops(hosts, *args)
        assert res.returncode == 7, (args, res.stdout + res.stderr)
        assert f"server container {name} does not exist on box; fix `server`" in one_line(res)
    assert host["orphan"].poll() is None
    res = ops(hosts, "restore-server")
    assert res.returncode == 8 and f"server container {name} does not exist on box" in one_line(res)


def test_systemd_server_on_a_host_without_systemd_stops_nothing(host):
    """systemd:UNIT on a host where systemd cannot be asked (this machine: no systemd as PID 1) is exit 7
    with systemctl's reason; the orphan holder is not signalled."""
    res = ops(host["hosts"]("systemd:vllm.service"), "gpu-clean")
    assert res.returncode == 7, res.stdout + res.stderr
    line = one_line(res)
    assert (
        "server systemd:vllm.service on box cannot be checked: systemctl: " in line and "nothing was" in line
    )
    assert host["orphan"].poll() is None


def test_server_that_outlives_its_stop_is_exit_7_and_no_holder_is_signalled(host, tmp_path, procs, devdir):
    """A pid-file server whose engine ignores SIGTERM and survives SIGKILL (frozen, D state) past the stop
    timeout: gpu-clean says the server did not stop, names the survivor, exits 7, and the orphan GPU
    holder keeps running."""
    api, engine = procs.server(tmp_path / "server.pid", [devdir / "nvidia0"])
    freezer = Freezer(f"eagle-ops-test-stop-{os.getpid()}")
    try:
        freezer.freeze(engine)
        res = ops(host["hosts"](f"pidfile:{tmp_path / 'server.pid'}"), "gpu-clean")
        assert res.returncode == 7, res.stdout + res.stderr
        line = one_line(res)
        assert (
            f"did not stop: {engine} VLLM::EngineCor state D survived SIGTERM and SIGKILL (3 s + 2 s)" in line
        )
        assert "no other GPU process was signalled" in line
        assert host["orphan"].poll() is None and alive(engine)
    finally:
        freezer.thaw_and_remove()


def test_failing_restart_command_is_exit_8(host, tmp_path):
    """A pid-file server whose start command fails at once: restore-server reports its exit code in one
    line and exits 8 (it is not taken for a started server)."""
    hosts = host["hosts"](
        f"pidfile:{tmp_path / 'none.pid'}", server_start=["sh", "-c", "echo no model >&2; exit 3"]
    )
    res = ops(hosts, "restore-server")
    assert res.returncode == 8, res.stdout + res.stderr
    assert "server pidfile:" in one_line(res) and "start command sh exited 3 within 2 s" in res.stderr


@pytest.mark.docker
def test_server_container_that_cannot_start_is_exit_8(host):
    """A server container that docker cannot start again (its command is gone): restore-server says so in
    one line and exits 8."""
    dk = client()
    ensure_base_image()
    name = unique("ops-test-broken-server")
    try:
        dk.containers.create(
            "eagle-ops-test-base:bookworm", ["/no/such/binary"], name=name, labels={"eagle-ops-test": "1"}
        )
        res = ops(host["hosts"](f"container:{name}"), "restore-server")
        assert res.returncode == 8, res.stdout + res.stderr
        assert f"server container:{name} was not restored: start server failed" in one_line(res)
    finally:
        remove_test_containers(dk, [name])
