"""The one SSH connection: host keys, bad hosts/ports/keys, connection reuse (real sshd on 127.0.0.1)."""

from __future__ import annotations

import json

from pathlib import Path

import pytest

from ops_helpers import run_ops, ssh_table, write_hosts
from ops.connection import LocalRunner, RemoteRunner
from ops.errors import ConnectError
from ops.hosts import HostConfig
from ops_sshd import keygen

pytestmark = pytest.mark.sshd


def host(sshd, known: Path, **kw) -> HostConfig:
    base = dict(
        name="t",
        host="127.0.0.1",
        port=sshd.port,
        user=sshd.user,
        key=str(sshd.user_key),
        known_hosts=str(known),
    )
    base.update(kw)
    return HostConfig(**base)


def test_commands_and_transfers_share_one_connection(sshd, tmp_path):
    """Several commands and an SFTP round trip go over a single TCP connection to sshd."""
    known = sshd.write_known_hosts(tmp_path / "known_hosts")
    before = sshd.connections()
    runner = RemoteRunner(host(sshd, known))
    try:
        assert runner.run("echo hello").stdout == "hello\n"
        assert runner.run("exit 7").exit_code == 7
        assert runner.run("cat", stdin="from stdin").stdout == "from stdin"
        src = tmp_path / "up.txt"
        src.write_text("payload")
        runner.put(src, str(tmp_path / "remote.txt"))
        runner.get(str(tmp_path / "remote.txt"), tmp_path / "down" / "back.txt")
        assert (tmp_path / "down" / "back.txt").read_text() == "payload"
    finally:
        runner.close()
    assert sshd.connections() - before == 1


def test_unknown_host_key_is_refused(sshd, tmp_path):
    """A host whose key is not in known_hosts is refused, with the fingerprint in the message."""
    known = tmp_path / "known_hosts"
    with pytest.raises(ConnectError, match="unknown .*--accept-new-host-key"):
        RemoteRunner(host(sshd, known))
    assert not known.exists()


def test_accept_new_host_key_records_it(sshd, tmp_path):
    """--accept-new-host-key trusts an unknown key once and records it, so the next connect needs no flag."""
    known = tmp_path / "known_hosts"
    RemoteRunner(host(sshd, known), accept_new_host_key=True).close()
    assert sshd.host_pub.split()[1] in known.read_text()
    RemoteRunner(host(sshd, known)).close()


def test_changed_host_key_is_refused_even_with_accept_flag(sshd, tmp_path):
    """A known host presenting another key is refused, also with --accept-new-host-key."""
    other = keygen(tmp_path / "other_host_key").split()
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{sshd.port} {other[0]} {other[1]}\n")
    with pytest.raises(ConnectError, match="CHANGED"):
        RemoteRunner(host(sshd, known), accept_new_host_key=True)


def test_refused_key(sshd, tmp_path):
    """A user key sshd does not authorize gives a 'refused our key' error, not a hang or a traceback."""
    keygen(tmp_path / "stranger")
    known = sshd.write_known_hosts(tmp_path / "known_hosts")
    with pytest.raises(ConnectError, match="refused our key"):
        RemoteRunner(host(sshd, known, key=str(tmp_path / "stranger")))


def test_cli_bad_hosts_are_one_line_errors(sshd, tmp_path):
    """Unknown host name, wrong port, refused key and unknown host key each end in one error line, exit 3."""
    from ops_sshd import free_port

    known = sshd.write_known_hosts(tmp_path / "known_hosts")
    keygen(tmp_path / "stranger")
    cases = {
        "unresolvable": dict(host="no-such-host.invalid"),
        "wrong-port": dict(port=free_port()),
        "bad-key": dict(key=str(tmp_path / "stranger")),
        "unknown-key": dict(known_hosts=str(tmp_path / "empty_known_hosts")),
    }
    for name, override in cases.items():
        table = ssh_table(sshd, known)
        table.update(override)
        hosts = write_hosts(tmp_path / f"{name}.toml", name, **table)
        res = run_ops("gpu-status", "--host", name, "--hosts-file", str(hosts))
        assert res.returncode == 3, (name, res.stdout, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), (name, res.stderr)
        assert name != "wrong-port" or "refused" in lines[0], res.stderr


def test_ssh_config_is_honoured(sshd, tmp_path):
    """A Host alias from ~/.ssh/config (HostName, Port, User, IdentityFile, UserKnownHostsFile) is
    enough for --host ALIAS with no hosts file, as with plain ssh."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    known = sshd.write_known_hosts(home / "kh")
    (home / ".ssh" / "config").write_text(
        f"Host gpu-alias\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n"
        f"  IdentityFile {sshd.user_key}\n  UserKnownHostsFile {known}\n"
    )
    before = sshd.connections()
    res = run_ops("gpu-status", "--host", "gpu-alias", "--json", env={"HOME": str(home)})
    # connected and probed: exit 0, or 6 where this machine's GPU facts cannot be read (no driver here)
    assert res.returncode == (6 if json.loads(res.stdout)["gpu_error"] else 0), res.stdout + res.stderr
    assert sshd.connections() - before == 1


def test_local_feed_streams_bytes_and_stops_when_the_command_exits():
    """feed() is the command's stdin, chunk by chunk, counted; a command that exits early stops the feed
    (docker load giving up) instead of blocking on a full pipe."""
    seen = []
    res = LocalRunner().feed("wc -c", (b"x" * 1000 for _ in range(5)), seen.append)
    assert res.ok and res.stdout.strip() == "5000" and seen == [1000] * 5

    def endless():
        while True:
            yield b"y" * 65536

    early = LocalRunner().feed("head -c 10 >/dev/null; exit 3", endless(), lambda _n: None)
    assert early.exit_code == 3


class _ClosingChannel:
    """A channel on which the server's exit status, its last output and its close all land between two
    of the runner's checks: the first look finds no status and an open channel, the next a closed one
    holding the status and unread output (paramiko's transport thread does this under load)."""

    def __init__(self):
        self.looks = 0
        self.closed = False
        self._out = [b"loaded\n"]

    def exec_command(self, command):
        pass

    def sendall(self, data):
        pass

    def shutdown_write(self):
        pass

    def close(self):
        pass

    def exit_status_ready(self):
        self.looks += 1
        if self.looks > 1:
            self.closed = True  # status, EOF and close came in one go
        return self.looks > 2

    def recv_ready(self):
        return self.closed and bool(self._out)

    def recv(self, n):
        return self._out.pop()

    def recv_stderr_ready(self):
        return False

    def recv_stderr(self, n):
        return b""

    def recv_exit_status(self):
        return 0

    def fileno(self):  # select() on it: a pipe that is never ready
        import os

        if not hasattr(self, "_pipe"):
            self._pipe = os.pipe()
        return self._pipe[0]


class _LateStderrChannel(_ClosingChannel):
    """A channel whose exit status comes first and its stderr, then EOF, two looks later, the channel left
    open (sshd sends the status when the command exits; what it wrote last can still be on its way)."""

    def __init__(self):
        super().__init__()
        self._out, self._err, self.eof_received = [], [], False

    def exit_status_ready(self):
        self.looks += 1
        if self.looks == 3:
            self._err, self.eof_received = [b"Error: No such image: x\n"], True
        return True

    def recv_stderr_ready(self):
        return bool(self._err)

    def recv_stderr(self, n):
        return self._err.pop()

    def recv_exit_status(self):
        return 1


def _fake_runner(chan):
    from types import SimpleNamespace

    import paramiko

    from ops.connection import CommandLog

    transport = SimpleNamespace(is_active=lambda: True, open_session=lambda: chan)
    runner = object.__new__(RemoteRunner)
    runner.label, runner.log, runner._paramiko = "t", CommandLog(), paramiko
    runner._conn = SimpleNamespace(client=SimpleNamespace(get_transport=lambda: transport))
    return runner


def test_an_exit_status_before_the_last_stderr_waits_for_it():
    """The race behind a false "`docker image inspect` failed: exit 1" with no message: the command's
    "No such image" came after its exit status; the runner reads until the channel's EOF, and has it."""
    result = _fake_runner(_LateStderrChannel()).run("docker image inspect x")
    assert (result.exit_code, result.stderr) == (1, "Error: No such image: x\n")


@pytest.mark.parametrize("how", ["run", "feed"])
def test_a_close_right_after_the_exit_status_is_not_a_lost_connection(how):
    """The race behind a false "connection lost during `docker load` (no exit status came)" after a
    complete load: a channel closed by the server with its status and output in hand is a finished command,
    its output read whole."""
    from types import SimpleNamespace

    import paramiko

    from ops.connection import CommandLog

    chan = _ClosingChannel()
    transport = SimpleNamespace(is_active=lambda: True, open_session=lambda: chan)
    runner = object.__new__(RemoteRunner)
    runner.label, runner.log, runner._paramiko = "t", CommandLog(), paramiko
    runner._conn = SimpleNamespace(client=SimpleNamespace(get_transport=lambda: transport))
    if how == "run":
        result = runner.run("docker load")
    else:
        result = runner.feed("docker load", [b"x"], lambda n: None)
    assert (result.exit_code, result.stdout) == (0, "loaded\n")
