"""The one connection to a host that a whole ops command uses.

Owns opening it (Fabric over paramiko, host keys checked against known_hosts; an unknown key is refused
unless the operator passed --accept-new-host-key, a changed key always is), running commands over it,
leaving one running with its stdin open (Runner.start: the host lock's keeper, which must end when this
connection does), moving files over it (SFTP on the same transport), and the local mode: the same
interface on this machine, for a GPU host without sshd (commands run through bash, files copied).
Everything else takes a Runner and never opens one. Commands are strings for the remote shell: callers
build them from argv with shlex (see ops.shell).
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from ops.errors import ConnectError, ConnectionLost, OpsError
from ops.hosts import HostConfig


@dataclass(frozen=True)
class Result:
    """What a command did: expected failures are data, not exceptions."""

    command: str
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class Runner(Protocol):
    """What every step needs from a connection."""

    label: str

    def run(
        self,
        command: str,
        *,
        stdin: str | None = None,
        timeout: float | None = None,
        stream: IO[str] | None = None,
    ) -> Result: ...

    def get(self, remote: str, local: Path) -> None: ...

    def put(self, local: Path, remote: str) -> None: ...

    def start(self, command: str) -> "Process": ...

    def feed(self, command: str, chunks: Iterable[bytes], on_bytes: Callable[[int], None]) -> Result: ...

    def close(self) -> None: ...


class Process:
    """A command left running on the host with its stdin open (Runner.start): lines are read from its
    stdout, text written to its stdin; close() closes stdin (the command sees EOF) and the channel.
    Writes may come from another thread (a heartbeat)."""

    label = ""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._write_lock = threading.Lock()

    def readline(self, timeout: float) -> str:
        """The next line of stdout ('' once it ended); OpsError if none came within timeout."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise OpsError(f"no answer from the host within {timeout:.0f} s ({self.label})")
            data = self._recv(min(left, 0.5))
            if data == b"":
                break
            if data:
                self._buf += data
        line, sep, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        return (line + sep).decode(errors="replace")

    def write(self, text: str) -> None:
        with self._write_lock:
            self._send(text.encode())

    def _recv(self, timeout: float) -> bytes | None:
        """Bytes of stdout, b'' at its end, None when nothing came within timeout."""
        raise NotImplementedError

    def _send(self, data: bytes) -> None:
        raise NotImplementedError

    def exited(self) -> bool:
        raise NotImplementedError

    def stderr(self) -> str:
        """What the command wrote to stderr so far (read once it exited)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class LocalProcess(Process):
    def __init__(self, command: str, label: str) -> None:
        super().__init__()
        self.label = label
        self._proc = subprocess.Popen(
            ["bash", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )

    def _recv(self, timeout):
        assert self._proc.stdout
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        return os.read(self._proc.stdout.fileno(), 65536) if ready else None

    def _send(self, data):
        assert self._proc.stdin
        self._proc.stdin.write(data)
        self._proc.stdin.flush()

    def exited(self):
        return self._proc.poll() is not None

    def stderr(self):
        assert self._proc.stderr
        ready, _, _ = select.select([self._proc.stderr], [], [], 0)
        return os.read(self._proc.stderr.fileno(), 65536).decode(errors="replace") if ready else ""

    def close(self):
        try:
            assert self._proc.stdin
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class ChannelProcess(Process):
    def __init__(self, chan, label: str) -> None:
        super().__init__()
        self.label = label
        self._chan = chan

    def _recv(self, timeout):
        ready, _, _ = select.select([self._chan], [], [], timeout)
        if not ready:
            return None
        return self._chan.recv(65536) if self._chan.recv_ready() or self._chan.eof_received else None

    def _send(self, data):
        self._chan.sendall(data)

    def exited(self):
        return self._chan.exit_status_ready() or self._chan.closed

    def stderr(self):
        out = bytearray()
        while self._chan.recv_stderr_ready():
            out += self._chan.recv_stderr(65536)
        return out.decode(errors="replace")

    def close(self):
        try:
            self._chan.shutdown_write()
        except (OSError, EOFError):
            pass
        self._chan.close()


@dataclass
class CommandLog:
    """Every command a runner ran, in order (for --verbose, tests and the benchmark)."""

    commands: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


class LocalRunner:
    """Runs commands on this machine through bash: the mode for a GPU host with no sshd."""

    def __init__(self, label: str = "local") -> None:
        self.label = label
        self.log = CommandLog()

    def run(self, command, *, stdin=None, timeout=None, stream=None) -> Result:
        start = time.monotonic()
        self.log.commands.append(command)
        try:
            if stream is None:
                proc = subprocess.run(
                    ["bash", "-c", command],
                    input=stdin if stdin is not None else "",
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                )
                out, err, code = proc.stdout, proc.stderr, proc.returncode
            else:
                out, err, code = _run_streaming(command, stdin, timeout, stream)
        except subprocess.TimeoutExpired:
            raise OpsError(f"command timed out after {timeout:.0f} s: {command[:120]}") from None
        self.log.seconds.append(time.monotonic() - start)
        return Result(command, code, out, err)

    def get(self, remote: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(remote, local)

    def put(self, local: Path, remote: str) -> None:
        shutil.copyfile(local, remote)

    def start(self, command: str) -> Process:
        self.log.commands.append(command)
        self.log.seconds.append(0.0)
        return LocalProcess(command, self.label)

    def feed(self, command, chunks, on_bytes) -> Result:
        """Run ``command`` with ``chunks`` (bytes) as its stdin; stop feeding once it has exited."""
        start = time.monotonic()
        self.log.commands.append(command)
        proc = subprocess.Popen(
            ["bash", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            for chunk in chunks:
                if proc.poll() is not None:
                    break
                try:
                    proc.stdin.write(chunk)
                except BrokenPipeError:
                    break
                on_bytes(len(chunk))
            out, err = proc.communicate()  # closes stdin (a broken pipe there is the early exit above)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        self.log.seconds.append(time.monotonic() - start)
        return Result(command, proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))

    def close(self) -> None:
        pass


def _run_streaming(command: str, stdin: str | None, timeout: float | None, stream: IO[str]):
    proc = subprocess.Popen(
        ["bash", "-c", command],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    assert proc.stdin and proc.stdout
    proc.stdin.write(stdin or "")
    proc.stdin.close()
    chunks = []
    try:
        for line in proc.stdout:
            chunks.append(line)
            stream.write(line)
            stream.flush()
        code = proc.wait(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return "".join(chunks), "", code


class _AcceptAndRecord:
    """paramiko policy for --accept-new-host-key: trust an unknown key and append it to known_hosts."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def missing_host_key(self, client, hostname, key) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as fh:
            fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


class _RefuseUnknown:
    def missing_host_key(self, client, hostname, key) -> None:
        import paramiko

        raise paramiko.SSHException(f"__unknown_host_key__ {key.get_name()} {sha256_fingerprint(key)}")


def sha256_fingerprint(key) -> str:
    """A host key's fingerprint as ssh and ssh-keygen -l show it: SHA256:<base64 of the digest, unpadded>."""
    import base64
    import hashlib

    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


class RemoteRunner:
    """One Fabric connection, opened once, reused for every command and SFTP transfer."""

    def __init__(self, host: HostConfig, *, accept_new_host_key: bool = False) -> None:
        import fabric
        import paramiko

        self.label = host.name
        self.host = host
        self.log = CommandLog()
        connect_kwargs: dict = {}
        if host.key:
            key = Path(host.key).expanduser()
            if not key.is_file():
                raise ConnectError(f"key file {key} does not exist; fix `key` for host {host.name}")
            # an explicit key is the only identity offered (like IdentitiesOnly=yes): a refused key is
            # reported as refused instead of silently trying the agent and ~/.ssh/id_*
            connect_kwargs.update(key_filename=str(key), look_for_keys=False, allow_agent=False)
        self._conn = fabric.Connection(
            host.host,
            user=host.user,
            port=host.port,
            connect_timeout=int(host.timeouts.connect),
            connect_kwargs=connect_kwargs,
        )
        known = self._known_hosts_path()
        client = self._conn.client
        if known.is_file():
            client.load_host_keys(str(known))
        policy = _AcceptAndRecord(known) if accept_new_host_key else _RefuseUnknown()
        client.set_missing_host_key_policy(policy)
        self._known = known
        self._paramiko = paramiko
        self._open()

    def _known_hosts_path(self) -> Path:
        if self.host.known_hosts:
            return Path(self.host.known_hosts).expanduser()
        configured = self._conn.ssh_config.get("userknownhostsfile")
        if configured:
            return Path(configured.split()[0]).expanduser()
        return Path("~/.ssh/known_hosts").expanduser()

    def _open(self) -> None:
        p = self._paramiko
        target = f"{self._conn.user}@{self._conn.host}:{self._conn.port}"
        try:
            self._conn.open()
            # keepalives keep NAT/firewall state alive through long silent stages (log follow)
            self._conn.transport.set_keepalive(30)
        except socket.gaierror:
            raise ConnectError(
                f"unknown host {self._conn.host!r}: name does not resolve; check HOST"
            ) from None
        except p.BadHostKeyException as exc:
            raise ConnectError(
                f"host key of {target} CHANGED (got {exc.key.get_name()} {sha256_fingerprint(exc.key)}, "
                f"{self._known} has {sha256_fingerprint(exc.expected_key)}); refusing. If the host was "
                f"reinstalled, remove its line from {self._known}"
            ) from None
        except p.PasswordRequiredException:  # before AuthenticationException, its base class
            key = self.host.key or "the private key"
            raise ConnectError(
                f"key {key} is encrypted: give its passphrase to an agent (ssh-add {key}) and use "
                "the agent (drop `key` from the hosts file), or use a key without a passphrase"
            ) from None
        except p.AuthenticationException:
            raise ConnectError(f"{target} refused our key/credentials; check `user` and `key`") from None
        except p.SSHException as exc:
            text = str(exc)
            if text.startswith("__unknown_host_key__"):
                _, kind, fp = text.split()
                raise ConnectError(
                    f"host key of {target} is unknown ({kind} {fp}) and not in {self._known}; verify it, "
                    "then pass --accept-new-host-key once"
                ) from None
            raise ConnectError(f"SSH to {target} failed: {text}") from None
        except (ConnectionRefusedError, TimeoutError, socket.timeout) as exc:
            what = "refused" if isinstance(exc, ConnectionRefusedError) else "timed out"
            raise ConnectError(f"connection to {target} {what}; check host and port") from None
        except p.ssh_exception.NoValidConnectionsError as exc:  # paramiko's wrapper: one error per address
            if all(isinstance(e, ConnectionRefusedError) for e in exc.errors.values()):
                raise ConnectError(f"connection to {target} refused; check host and port") from None
            raise ConnectError(f"cannot connect to {target}: {exc}") from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {target}: {exc.strerror or exc}") from None

    def run(self, command, *, stdin=None, timeout=None, stream=None) -> Result:
        """Exec on a new channel of the one transport. Not invoke's runner: it feeds stdin one byte per
        10 ms from non-terminal streams, far too slow for the agent's payload."""
        start = time.monotonic()
        self.log.commands.append(command)
        try:
            code, out, err = self._exec(command, stdin, timeout, stream)
        except (self._paramiko.SSHException, EOFError, OSError) as exc:
            raise ConnectionLost(f"connection to {self.label} lost during {_brief(command)}: {exc}") from None
        self.log.seconds.append(time.monotonic() - start)
        return Result(command, code, out, err)

    def _exec(self, command: str, stdin: str | None, timeout: float | None, stream: IO[str] | None):
        transport = self._conn.client.get_transport()
        if transport is None or not transport.is_active():
            raise ConnectionLost(
                f"connection to {self.label} lost during {_brief(command)}: the SSH transport is closed"
            )
        chan = transport.open_session()
        deadline = None if timeout is None else time.monotonic() + timeout
        out, err = bytearray(), bytearray()
        try:
            chan.exec_command(command)
            if stdin:
                chan.sendall(stdin.encode())
            chan.shutdown_write()
            while True:
                got = _drain(chan.recv_ready, chan.recv, out, stream)
                got = _drain(chan.recv_stderr_ready, chan.recv_stderr, err, stream) or got
                state = _state(chan, transport, out, err, stream)
                if state == "done":
                    break
                if state == "lost":  # connection dropped: no exit status will come
                    raise ConnectionLost(
                        f"connection to {self.label} lost during {_brief(command)} (no exit status came)"
                    )
                if deadline is not None and time.monotonic() > deadline:
                    raise OpsError(f"remote command timed out after {timeout:.0f} s: {command[:120]}")
                if not got:
                    select.select([chan], [], [], 0.05)
            code = chan.recv_exit_status()
            if (
                code == -1 and not transport.is_active()
            ):  # paramiko's "no exit status": the connection dropped
                raise ConnectionLost(
                    f"connection to {self.label} lost during {_brief(command)} (no exit status came)"
                )
        finally:
            chan.close()
        return code, out.decode(errors="replace"), err.decode(errors="replace")

    def get(self, remote: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        self._conn.sftp().get(remote, str(local))

    def put(self, local: Path, remote: str) -> None:
        self._conn.sftp().put(str(local), remote)

    def feed(self, command, chunks, on_bytes) -> Result:
        """Exec ``command`` on a new channel of the one transport with ``chunks`` (bytes) as its stdin, sent
        as they come (a multi-GB ``docker save`` never sits in memory); stop feeding once it has exited."""
        start = time.monotonic()
        self.log.commands.append(command)
        out, err = bytearray(), bytearray()
        try:
            transport = self._conn.client.get_transport()
            if transport is None or not transport.is_active():
                raise ConnectionLost(
                    f"connection to {self.label} lost during {_brief(command)}: the SSH transport is closed"
                )
            chan = transport.open_session()
            try:
                chan.exec_command(command)
                for chunk in chunks:
                    if chan.exit_status_ready():
                        break  # the command gave up early; its stderr says why
                    chan.sendall(chunk)
                    on_bytes(len(chunk))
                    _drain(chan.recv_ready, chan.recv, out, None)
                    _drain(chan.recv_stderr_ready, chan.recv_stderr, err, None)
                chan.shutdown_write()
                while True:
                    got = _drain(chan.recv_ready, chan.recv, out, None)
                    got = _drain(chan.recv_stderr_ready, chan.recv_stderr, err, None) or got
                    state = _state(chan, transport, out, err, None)
                    if state == "done":
                        break
                    if state == "lost":
                        raise ConnectionLost(
                            f"connection to {self.label} lost during {_brief(command)} (no exit status came)"
                        )
                    if not got:
                        select.select([chan], [], [], 0.05)
                code = chan.recv_exit_status()
            finally:
                chan.close()
        except (self._paramiko.SSHException, EOFError, OSError) as exc:
            raise ConnectionLost(f"connection to {self.label} lost during {_brief(command)}: {exc}") from None
        self.log.seconds.append(time.monotonic() - start)
        return Result(command, code, out.decode(errors="replace"), err.decode(errors="replace"))

    def start(self, command: str) -> Process:
        """Exec on a new channel of the one transport and leave it running (see Process)."""
        self.log.commands.append(command)
        self.log.seconds.append(0.0)
        try:
            transport = self._conn.client.get_transport()
            if transport is None or not transport.is_active():
                raise ConnectionLost(
                    f"connection to {self.label} lost during {_brief(command)}: the SSH transport is closed"
                )
            chan = transport.open_session()
            chan.exec_command(command)
        except (self._paramiko.SSHException, EOFError, OSError) as exc:
            raise ConnectionLost(f"connection to {self.label} lost during {_brief(command)}: {exc}") from None
        return ChannelProcess(chan, self.label)

    def close(self) -> None:
        self._conn.close()


def _brief(command: str) -> str:
    """What a remote command is, for a one-line message: its program and first words, at most 80
    characters, whitespace (a multi-line ``-c`` program) folded; the host agent by that name."""
    if "eagle_ops_hostagent" in command:  # ops.agent.BOOTSTRAP
        return "the host agent (`python3 -c BOOTSTRAP`)"
    command = " ".join(command.split())
    return f"`{command[:77] + '...' if len(command) > 80 else command}`"


def _state(chan, transport, out: bytearray, err: bytearray, stream: IO[str] | None) -> str:
    """Where a command's channel stands: "done" (its exit status came and everything it sent is read),
    "lost" (the channel or the connection closed with no exit status) or "running". The close is looked at
    first: the server sends the status before it closes the channel (OpenSSH: exit-status, EOF, close), so
    a channel seen closed already holds any status it will get, and what was buffered before the close is
    read then. Looking at the status first let paramiko's transport thread take all three between the two
    looks, and a complete command read as a lost connection (seen under load: "connection lost during
    `docker load` (no exit status came)"). An open channel is done only once its EOF came too: the status may
    come before the last of the output (sshd sends it when the command exits, and what the command wrote
    last may still be on its way), and reading it as done lost `docker image inspect`'s "No such image"
    (seen under load: an empty stderr and exit 1)."""
    if chan.closed or not transport.is_active():
        _drain(chan.recv_ready, chan.recv, out, stream)
        _drain(chan.recv_stderr_ready, chan.recv_stderr, err, stream)
        return "done" if chan.exit_status_ready() else "lost"
    if (
        chan.exit_status_ready()
        and chan.eof_received
        and not chan.recv_ready()
        and not chan.recv_stderr_ready()
    ):
        return "done"
    return "running"


def _drain(ready, recv, buf: bytearray, stream: IO[str] | None) -> bool:
    """Move whatever a channel has ready into buf (and the live stream); True if anything came."""
    got = False
    while ready():
        data = recv(65536)
        buf += data
        got = True
        if stream is not None:
            stream.write(data.decode(errors="replace"))
            stream.flush()
    return got


def connect(host: HostConfig, *, accept_new_host_key: bool = False) -> Runner:
    """Open the command's one connection (or the local runner for host `local`)."""
    if host.is_local:
        return LocalRunner(host.name)
    return RemoteRunner(host, accept_new_host_key=accept_new_host_key)
