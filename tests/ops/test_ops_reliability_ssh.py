"""SSH errors say what ssh would: SHA256 fingerprints, an encrypted key named as such, and a connection
lost mid-command named with the command (real sshd on 127.0.0.1)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ops.connection import RemoteRunner
from ops.errors import ConnectError, OpsError
from ops_sshd import keygen
from test_ops_connection import host

pytestmark = pytest.mark.sshd


def ssh_keygen_fingerprint(pub_line: str, tmp_path: Path) -> str:
    """The fingerprint `ssh-keygen -l` prints for a public key line (SHA256:...)."""
    path = tmp_path / "k.pub"
    path.write_text(pub_line + "\n")
    return subprocess.run(
        ["ssh-keygen", "-l", "-f", str(path)], capture_output=True, text=True, check=True
    ).stdout.split()[1]


def test_unknown_host_key_is_shown_as_ssh_shows_it(sshd, tmp_path):
    """The unknown host key's fingerprint is the SHA256 one ssh-keygen prints, not MD5 hex."""
    expected = ssh_keygen_fingerprint(sshd.host_pub, tmp_path)
    with pytest.raises(ConnectError) as info:
        RemoteRunner(host(sshd, tmp_path / "known_hosts"))
    assert expected.startswith("SHA256:") and expected in str(info.value), str(info.value)


def test_changed_host_key_shows_both_sha256_fingerprints(sshd, tmp_path):
    """A changed host key names the key presented and the one known_hosts has, both as SHA256."""
    other = keygen(tmp_path / "other_host_key")
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{sshd.port} {' '.join(other.split()[:2])}\n")
    with pytest.raises(ConnectError, match="CHANGED") as info:
        RemoteRunner(host(sshd, known))
    got, expected = ssh_keygen_fingerprint(sshd.host_pub, tmp_path), ssh_keygen_fingerprint(other, tmp_path)
    assert got in str(info.value) and expected in str(info.value), str(info.value)


def test_encrypted_key_is_named_encrypted_not_refused(sshd, tmp_path):
    """A passphrase-protected key without its passphrase: 'is encrypted' and what to do, not 'refused our
    key'."""
    key = tmp_path / "locked"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret-pass", "-f", str(key)], check=True)
    authorized = sshd.root / "authorized_keys"
    before = authorized.read_text()
    authorized.write_text(before + (tmp_path / "locked.pub").read_text())  # sshd would accept it
    known = sshd.write_known_hosts(tmp_path / "known_hosts")
    try:
        with pytest.raises(ConnectError) as info:
            RemoteRunner(host(sshd, known, key=str(key)))
    finally:
        authorized.write_text(before)
    text = str(info.value)
    assert "is encrypted" in text and "ssh-add" in text and "refused" not in text, text


def test_connection_lost_mid_command_names_the_host_and_the_command(sshd, tmp_path):
    """sshd's session killed while a command runs: 'connection to HOST lost during `COMMAND`', no hang."""
    known = sshd.write_known_hosts(tmp_path / "known_hosts")
    runner = RemoteRunner(host(sshd, known))
    errors: list[BaseException] = []

    def work() -> None:
        try:
            runner.run("sleep 30", timeout=60)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    worker = threading.Thread(target=work)
    started = time.monotonic()
    worker.start()
    time.sleep(1.0)
    sessions = subprocess.run(
        ["pgrep", "-P", str(sshd.proc.pid)], capture_output=True, text=True, check=False
    ).stdout.split()
    assert sessions
    for pid in sessions:  # only our sshd's per-connection children
        os.kill(int(pid), signal.SIGKILL)
    worker.join(timeout=40)
    runner.close()
    assert not worker.is_alive() and time.monotonic() - started < 30
    assert errors and isinstance(errors[0], OpsError), errors
    assert "connection to t lost during `sleep 30`" in str(errors[0]), str(errors[0])


def test_command_on_a_closed_connection_names_it(sshd, tmp_path):
    """A command sent after the connection closed says which connection and which command."""
    known = sshd.write_known_hosts(tmp_path / "known_hosts")
    runner = RemoteRunner(host(sshd, known))
    runner.close()
    with pytest.raises(OpsError, match="connection to t lost during `echo hi`"):
        runner.run("echo hi")
