"""stop-server by pid file spares every process ops itself started over its SSH connection, not only the
agent's own ancestry (real sshd, real processes)."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest

from ops import server
from ops.connection import RemoteRunner
from ops.errors import OpsError
from ops.gpus import probe
from ops.hosts import load_hosts_file
from ops_procs import alive, wait_for
from test_ops_server import hosts_for

pytestmark = pytest.mark.sshd


def _pid_of(marker: str) -> int | None:
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True, check=False).stdout.split()
    return int(out[0]) if out else None


def test_pidfile_naming_an_ops_helper_signals_nothing(tmp_path, sshd, devdir):
    """A pid file that names a helper ops started over this connection (a lock keeper, a log follower): the
    probe tells that group as ops' own, the stop refuses in one line (exit 7) and signals nothing of it, and
    the helper lives on."""
    pidfile = tmp_path / "server.pid"
    host = load_hosts_file(hosts_for(tmp_path, sshd, devdir, f"pidfile:{pidfile}"))["box"]
    runner = RemoteRunner(host)
    marker = f"eagle-ops-helper-{uuid.uuid4().hex[:8]}"
    helper = runner.start(f"exec {sys.executable} -c 'import time; time.sleep(300)' {marker}")
    try:
        wait_for(lambda: _pid_of(marker) is not None)
        pid = _pid_of(marker)
        time.sleep(0.05)
        pidfile.write_text(str(pid))  # newer than the process: not a stale pid file
        facts = probe(runner, host).server
        assert facts.pgid is not None and pid in facts.members and pid in facts.ours and not facts.running
        with pytest.raises(OpsError, match="points at the operator's own processes") as info:
            server.stop(runner, host, facts)
        assert info.value.exit_code == 7 and "\n" not in str(info.value)
        assert alive(pid), "ops' own helper was signalled"
    finally:
        helper.close()
        if (pid := _pid_of(marker)) is not None:
            subprocess.run(["kill", "-9", str(pid)], check=False)
        runner.close()
