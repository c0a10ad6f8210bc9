"""The ops classes of issue #32: a pid file that names ops' own process (or a group holding its helpers) is
never signalled, gpu-status does not pass unreadable GPU facts for a status, and a connection lost in the
middle of a command exits with the connection's code (3), not a failed step's (real sshd, real processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ops.errors import OpsError
from ops_helpers import REPO, run_ops, ssh_table, write_hosts
from ops_procs import alive, wait_for, write_gpu_table

REPO_ROOT = Path(REPO)


def _ops_in_own_group(pidfile: Path, who: str, *args: str) -> subprocess.Popen:
    """`python -m ops ARGS` in a new process group whose pid ``pidfile`` names at once: with who="ops" ops is
    the group's leader and the pid its own; with who="shell" an operator's shell leads the group, wrote its
    own pid (`echo $$`) and runs ops as its child. Either way the group holds ops and every helper it
    starts."""
    cmd = [sys.executable, "-m", "ops", *args]
    if who == "shell":  # not the last command of `bash -c`, so bash forks it rather than exec it
        cmd = ["bash", "-c", 'echo $$ > "$0"; "$@"; rc=$?; exit $rc', str(pidfile), *cmd]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, COLUMNS="200"),
        start_new_session=True,
    )
    if who == "ops":
        pidfile.write_text(f"{proc.pid}\n")  # newer than the process: not taken for a reused pid
    return proc


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, err


def _refused_as_ours(rc: int, out: str, err: str, pidfile: Path) -> None:
    """The one-line refusal of a pid file that points at the operator's own processes: exit 7 (ops was not
    signalled: a signal would end it with -15 or -9), nothing reported as stopped, nothing of ops named as
    the server's."""
    assert rc == 7, (rc, out, err)
    line = err.strip()
    assert line.startswith(f"error: the pid file of server pidfile:{pidfile} on ") and "\n" not in line, err
    assert "points at the operator's own processes" in line and "nothing was signalled" in line, err
    assert "stopped server" not in out and "still has processes" not in err, (out, err)
    assert "TERM" not in out and "KILL" not in out, out


@pytest.mark.sshd
@pytest.mark.parametrize("who", ["ops", "shell"])
def test_pidfile_pointing_at_the_operator_over_ssh_is_refused(tmp_path, sshd, devdir, who):
    """stop-server by a pid file that names the ops process itself, or the operator's shell that runs it (the
    host is this machine, over SSH): nothing of that group is signalled, and stop-server refuses in one line
    that the pid file points at the operator's own processes, exit 7 (before: "stopped server ..." and then
    "still has processes after stop" naming ops' own pids)."""
    pidfile = tmp_path / "server.pid"
    known = sshd.write_known_hosts(tmp_path / "known_hosts")
    table = write_gpu_table(tmp_path / "gpus.json", [{"processes": []}])
    hosts = write_hosts(
        tmp_path / "hosts.toml",
        "box",
        **ssh_table(
            sshd,
            known,
            server=f"pidfile:{pidfile}",
            device_glob=f"{devdir}/nvidia*",
            gpu_source=f"table:{table}",
            timeouts={"grace": 1, "kill_wait": 2, "stop": 3, "clean": 3},
        ),
    )
    rc, out, err = _finish(
        _ops_in_own_group(pidfile, who, "stop-server", "--host", "box", "--hosts-file", str(hosts))
    )
    _refused_as_ours(rc, out, err, pidfile)


@pytest.mark.parametrize("who", ["ops", "shell"])
def test_pidfile_pointing_at_the_operator_on_a_local_host_is_refused(tmp_path, devdir, who):
    """The same on host `local`, where ops is the agent's ancestor: stop-server, gpu-clean and restore-server
    each refuse in that one line (restore-server's exit 8: it would start nothing beside ops' own group),
    nothing of the group is signalled or reported as the server's."""
    pidfile = tmp_path / "server.pid"
    table = write_gpu_table(tmp_path / "gpus.json", [{"processes": []}])
    hosts = write_hosts(
        tmp_path / "hosts.toml",
        "here",
        host="local",
        python="/usr/bin/python3",
        server=f"pidfile:{pidfile}",
        server_start=["/bin/true"],
        device_glob=f"{devdir}/nvidia*",
        gpu_source=f"table:{table}",
        timeouts={"grace": 1, "kill_wait": 2, "stop": 3, "clean": 3},
        lock_file=str(tmp_path / "eagle-ops.lock"),
    )
    where = ("--host", "here", "--hosts-file", str(hosts))
    for command in ("stop-server", "gpu-clean"):
        _refused_as_ours(*_finish(_ops_in_own_group(pidfile, who, command, *where)), pidfile)
    rc, out, err = _finish(_ops_in_own_group(pidfile, who, "restore-server", *where))
    assert rc == 8 and "points at the operator's own processes" in err and err.strip().count("\n") == 0, (
        rc,
        out,
        err,
    )


def test_a_server_group_beside_ops_is_still_stopped(tmp_path, devdir, procs):
    """Control: a pid-file server that is not ops' is stopped as before (its whole group), exit 0."""
    pidfile = tmp_path / "server.pid"
    api, engine = procs.server(pidfile, [devdir / "nvidia0"])
    table = write_gpu_table(tmp_path / "gpus.json", [{"processes": []}])
    hosts = write_hosts(
        tmp_path / "hosts.toml",
        "here",
        host="local",
        python="/usr/bin/python3",
        server=f"pidfile:{pidfile}",
        device_glob=f"{devdir}/nvidia*",
        gpu_source=f"table:{table}",
        timeouts={"grace": 1, "kill_wait": 2, "stop": 3, "clean": 3},
        lock_file=str(tmp_path / "eagle-ops.lock"),
    )
    res = run_ops("stop-server", "--host", "here", "--hosts-file", str(hosts))
    assert res.returncode == 0, res.stdout + res.stderr
    wait_for(lambda: not alive(api.pid) and not alive(engine))


@pytest.mark.parametrize("as_json", [False, True])
def test_gpu_status_with_unreadable_gpu_facts_is_not_a_status(tmp_path, devdir, as_json):
    """gpu-status whose GPU facts cannot be read (here: the table file is missing) shows what it read and
    exits 6 with one `error:` line naming the host and the reason (before: exit 0)."""
    hosts = write_hosts(
        tmp_path / "hosts.toml",
        "here",
        host="local",
        python="/usr/bin/python3",
        device_glob=f"{devdir}/nvidia*",
        gpu_source=f"table:{tmp_path / 'no-such-table.json'}",
        lock_file=str(tmp_path / "eagle-ops.lock"),
    )
    res = run_ops(
        "gpu-status", "--host", "here", "--hosts-file", str(hosts), *(["--json"] if as_json else [])
    )
    err = res.stderr.strip()
    assert res.returncode == 6, res.stdout + res.stderr
    assert err.startswith("error: cannot read the GPU facts of here: ") and "\n" not in err, err
    assert "no-such-table.json" in err, err


@pytest.mark.sshd
def test_connection_lost_during_gpu_clean_exits_with_the_connection_code(tmp_path, sshd, devdir, procs):
    """sshd's session processes killed while gpu-clean waits out a TERM-ignoring holder's grace: one line
    "connection to box lost during ...", exit 3 (EXIT_CONNECT; before: exit 1, read as a failed step)."""
    stubborn = procs.holder([devdir / "nvidia0"], name="stubborn", ignore_term=True)
    orphan = procs.holder([devdir / "nvidia1"], name="orphan")
    table = write_gpu_table(
        tmp_path / "gpus.json",
        [{"processes": [{"pid": stubborn.pid, "used_mib": 1000}, {"pid": orphan.pid, "used_mib": 10}]}],
    )
    known = sshd.write_known_hosts(tmp_path / "known_hosts")
    hosts = write_hosts(
        tmp_path / "hosts.toml",
        "box",
        **ssh_table(
            sshd,
            known,
            device_glob=f"{devdir}/nvidia*",
            gpu_source=f"table:{table}",
            timeouts={"grace": 60, "kill_wait": 2, "stop": 3, "clean": 3},
        ),
    )
    before = set(_sessions(sshd))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ops", "gpu-clean", "--host", "box", "--hosts-file", str(hosts)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, COLUMNS="200"),
    )
    try:
        # both holders get one TERM: once the orphan is gone the agent waits out the stubborn one's grace
        wait_for(lambda: not alive(orphan.pid), timeout=60)
        time.sleep(0.5)
        for pid in set(_sessions(sshd)) - before:  # only this test's connection
            os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, (proc.returncode, out, err)
    line = err.strip()
    assert line.startswith("error: connection to box lost during") and "\n" not in line, line


def _sessions(sshd) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(sshd.proc.pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_a_run_file_on_a_full_disk_is_one_line_and_leaves_no_temp_file(tmp_path):
    """A run file (state.json, run.json, ...) written to a full disk (a 4 KiB tmpfs): one line naming the file
    and "No space left on device", no `.tmp` left, the previous file intact (before: an OSError traceback
    and a cut temp file)."""
    from ops.runstate import write_json

    mnt = tmp_path / "runs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(mnt)], check=True)
    try:
        (mnt / "state.json").write_text('{"status": "running"}')
        with pytest.raises(OpsError) as info:
            write_json(mnt / "state.json", {"log": "x" * 20000})
        text = str(info.value)
        assert f"cannot write {mnt / 'state.json'}: No space left on device" in text and "\n" not in text, (
            text
        )
        assert sorted(p.name for p in mnt.iterdir()) == ["state.json"]
        assert json.loads((mnt / "state.json").read_text()) == {"status": "running"}
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
