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


def _ops_in_own_group(pidfile: Path, *args: str) -> subprocess.Popen:
    """`python -m ops ARGS` as the leader of a new process group, its pid written to ``pidfile`` at once (the
    pid file then names ops' own process, and its group holds every helper ops starts)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ops", *args],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, COLUMNS="200"),
        start_new_session=True,
    )
    pidfile.write_text(f"{proc.pid}\n")  # newer than the process: not taken for a reused pid
    return proc


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, err


@pytest.mark.sshd
def test_pidfile_naming_ops_itself_over_ssh_signals_nothing_of_ops(tmp_path, sshd, devdir):
    """stop-server by a pid file that names the ops process itself (the host is this machine, over SSH):
    ops and its group live, stop-server reports the server still running in one line (exit 7); before,
    the agent sent ops its own SIGTERM (exit -15)."""
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
        _ops_in_own_group(pidfile, "stop-server", "--host", "box", "--hosts-file", str(hosts))
    )
    assert rc == 7, (rc, out, err)
    assert err.strip().startswith("error: server pidfile:") and "\n" not in err.strip(), err
    assert "still has processes after stop" in err


def test_pidfile_naming_ops_itself_on_a_local_host_spares_its_helpers(tmp_path, devdir):
    """The same on host `local`, where ops is the agent's ancestor: its whole group (ops, the lock keeper,
    the agent) is spared, nothing of it is stopped, exit 7 in one line. (This held before the fix too, by
    the agent's ancestry; kept as the local half of the SSH case above.)"""
    pidfile = tmp_path / "server.pid"
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
    rc, out, err = _finish(
        _ops_in_own_group(pidfile, "stop-server", "--host", "here", "--hosts-file", str(hosts))
    )
    assert rc == 7, (rc, out, err)
    assert "still has processes after stop" in err and err.strip().count("\n") == 0, err
    assert "TERM" not in out and "KILL" not in out, out


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
