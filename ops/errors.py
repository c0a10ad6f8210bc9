"""Errors and exit codes of ops.

Owns the exception type every ops module raises for expected failures (bad input, refused connection,
failed remote command) and the table of exit codes. Only the CLI turns these into exit codes; checks and
plans return values.
"""

from __future__ import annotations

# Exit codes of `python -m ops`. A stage's own exit code is propagated verbatim by remote-run/attach.
EXIT_OK = 0
EXIT_ERROR = 1  # a remote step failed (the message says which)
EXIT_USAGE = 2  # bad input: host spec, hosts file, strategy, path (click also uses 2)
EXIT_CONNECT = 3  # cannot connect (unknown host, refused, bad key, unknown or changed host key), or lost it
EXIT_PREFLIGHT = 4  # a preflight check failed; nothing was stopped or started
EXIT_UNKILLABLE = 5  # a GPU holder survived SIGKILL: reboot needed
EXIT_NOT_CLEAN = 6  # GPUs still busy (compute process or memory over threshold) after the timeout
# the server did not stop (target missing, stop failed or timed out, survivors); no GPU process signalled
EXIT_SERVER_STOP = 7
EXIT_SERVER_RESTORE = 8  # the server was not brought back (target missing, start command failed)
# another ops command holds the host lock, or a stage container of this output/host exists: wait or attach
EXIT_BUSY = 9
EXIT_RESPAWNED = (
    10  # a GPU holder came back after each of gpu-clean's kill rounds: its supervisor (named) must
)
#                     be stopped first (systemd unit, restart policy, process manager); it was not killed
EXIT_CANNOT_SIGNAL = (
    11  # a GPU holder may not be signalled by the SSH user (EPERM): connect as root or its owner
)
EXIT_HOSTS_FAILED = 13  # several hosts: at least one host's shard is not complete (its row says why); the
#                        others' shards are intact, and re-running the same command redoes only those hosts
EXIT_INTERRUPTED = 130


class OpsError(Exception):
    """An expected failure with a one-line message and the exit code the CLI should use."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str, *, exit_code: int | None = None, detail: str = "") -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
        #: extra output (e.g. the failing command's stderr), shown below the one-line message
        self.detail = detail


class ConfigError(OpsError):
    """Bad host spec, hosts file, strategy or argument."""

    exit_code = EXIT_USAGE


class ConnectError(OpsError):
    """The SSH connection could not be made or was not trusted."""

    exit_code = EXIT_CONNECT


class ConnectionLost(ConnectError):
    """The connection dropped while a command ran on it: no exit status came, so whether the command
    finished is unknown; the exit code is the connection's (EXIT_CONNECT), never a failed step's."""

    def __init__(self, message: str, **kwargs) -> None:
        hint = "whether it finished is unknown: reconnect, check the host (`gpu-status`), then re-run"
        super().__init__(f"{message}; {hint}", **kwargs)


class RemoteCommandError(OpsError):
    """A remote command failed; carries the command and its output."""

    def __init__(self, what: str, command: str, exit_code: int, stdout: str, stderr: str) -> None:
        lines = (stderr.strip() or stdout.strip()).splitlines()
        # the line that names the error, else the last one (docker's last line is a --help hint)
        tail = next((ln.strip() for ln in lines if "rror" in ln), lines[-1] if lines else "no output")
        super().__init__(f"{what} failed (exit {exit_code}): {tail}", detail=f"$ {command}\n{stderr}")
        self.command = command
        self.remote_exit_code = exit_code
        self.stdout = stdout
        self.stderr = stderr
