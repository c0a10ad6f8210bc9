"""Fixtures that start real services for the ops tests (sshd, hosts files)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ops_procs import Procs
from ops_sshd import Sshd, start_sshd


@pytest.fixture(scope="session")
def sshd(tmp_path_factory) -> Sshd:
    """One real sshd on 127.0.0.1 for the whole session (generated host and user keys)."""
    assert shutil.which("ssh-keygen") and Path("/usr/sbin/sshd").exists(), "openssh-server is not installed"
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


@pytest.fixture
def procs(tmp_path):
    """Real processes started by the test; none outlives it."""
    p = Procs(tmp_path)
    yield p
    p.cleanup()


@pytest.fixture
def devdir(tmp_path) -> Path:
    """A temporary "device" directory: empty files named like /dev/nvidia*, plus one outside the glob."""
    d = tmp_path / "dev"
    d.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "unrelated"):
        (d / name).write_bytes(b"")
    return d
