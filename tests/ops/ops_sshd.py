"""A real OpenSSH server on 127.0.0.1 for the tests: generated host and user keys, logs to a file."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ops_procs import terminate

SSHD = "/usr/sbin/sshd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return (path.with_suffix(".pub") if path.suffix else Path(str(path) + ".pub")).read_text().strip()


@dataclass
class Sshd:
    root: Path
    port: int
    user: str
    user_key: Path
    host_pub: str
    log: Path
    proc: subprocess.Popen

    @property
    def known_hosts_line(self) -> str:
        kind, b64 = self.host_pub.split()[:2]
        return f"[127.0.0.1]:{self.port} {kind} {b64}\n"

    def write_known_hosts(self, path: Path) -> Path:
        path.write_text(self.known_hosts_line)
        return path

    def connections(self) -> int:
        """TCP connections sshd accepted so far (its VERBOSE log's 'Connection from' lines)."""
        return len(re.findall(r"Connection from 127\.0\.0\.1 port", self.log.read_text()))

    def stop(self) -> None:
        terminate(self.proc, 5)

    def start_again(self) -> None:
        """After stop(): the same server (config, port, host key) comes back."""
        self.proc = _launch(self.root, self.log)


def _launch(root: Path, log: Path) -> subprocess.Popen:
    mark = log.read_text().count("Server listening on 127.0.0.1") if log.exists() else 0
    proc = subprocess.Popen([SSHD, "-D", "-f", str(root / "sshd_config"), "-E", str(log)])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        # wait for sshd's own log line rather than probing the port: a probe would count as a connection
        if log.exists() and log.read_text().count("Server listening on 127.0.0.1") > mark:
            return proc
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited: {log.read_text() if log.exists() else ''}")
        time.sleep(0.05)
    raise RuntimeError("sshd did not listen within 10 s")


def start_sshd(root: Path, env: dict[str, str] | None = None) -> Sshd:
    """env: extra variables every session gets (a second test host points DOCKER_HOST at its own engine)."""
    root.mkdir(parents=True, exist_ok=True)
    host_pub = keygen(root / "host_key")
    user_pub = keygen(root / "user_key")
    (root / "authorized_keys").write_text(user_pub + "\n")
    os.chmod(root / "authorized_keys", 0o600)
    port = free_port()
    log = root / "sshd.log"
    (root / "sshd_config").write_text(
        "\n".join(
            [
                f"Port {port}",
                "ListenAddress 127.0.0.1",
                f"HostKey {root / 'host_key'}",
                f"PidFile {root / 'sshd.pid'}",
                f"AuthorizedKeysFile {root / 'authorized_keys'}",
                "PermitRootLogin prohibit-password",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "LogLevel VERBOSE",
                "MaxSessions 64",
                "MaxStartups 64",
                "SetEnv PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
                + "".join(f" {k}={v}" for k, v in (env or {}).items()),
                "Subsystem sftp internal-sftp",
                "",
            ]
        )
    )
    Path("/run/sshd").mkdir(exist_ok=True)
    proc = _launch(root, log)
    import pwd

    return Sshd(root, port, pwd.getpwuid(os.getuid()).pw_name, root / "user_key", host_pub, log, proc)
