"""Secrets for the stage container: which ones travel, how, and keeping their values out of every output.

Owns the rule for what counts as a secret (HF_TOKEN and every variable named *_TOKEN, *_KEY, *_SECRET or
*_PASSWORD), taking the values that a host's `secrets` list names from the operator's environment, the
env-file text, and the one remote command that carries them: it sets umask 077 before anything exists,
makes a fresh 0700 directory, writes the 0600 file from stdin (values never appear in a command line,
so never in `ps`), checks that it arrived whole, runs `docker run --env-file`, and removes the directory
on exit or hangup, so the file lives only while the docker CLI reads it. Also owns the redactor that
run.json, stage.log, the console's stage output, error messages and the trace file go through: names
may be shown, values never.
Does not choose the container's other flags (ops.stage) and runs nothing itself (ops.remote_run).
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterable, Mapping
from typing import IO

from ops.errors import ConfigError

SECRET_NAME = re.compile(r"(?:^|_)(?:TOKEN|KEY|SECRET|PASSWORD)$", re.IGNORECASE)
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MASK = "[redacted]"
MIN_REDACT = 4  # shorter values are not redacted (they would mangle ordinary text and are no secret)
ENV_FILE = "env"  # the file's name inside the per-run directory
END = "# end of eagle-ops secrets"  # the env file's last line (docker skips comment lines)


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def available(names: Iterable[str], environ: Mapping[str, str]) -> tuple[str, ...]:
    """The configured names that are set (non-empty) in the operator's environment, in order."""
    return tuple(n for n in names if environ.get(n))


def env_file_text(names: Iterable[str], environ: Mapping[str, str]) -> str:
    """`NAME=value` lines for docker's --env-file; every value sent is also registered for redaction.
    A value docker's env-file format cannot carry (newline, NUL) is refused, naming only the variable."""
    lines = []
    for name in names:
        value = environ[name]
        if any(c in value for c in "\n\r\0"):
            raise ConfigError(f"secret {name} contains a newline or NUL; an env file cannot carry it")
        protect([value])
        lines.append(f"{name}={value}\n")
    return "".join(lines) + END + "\n"


def env_dir(secrets_dir: str, run_id: str, token: str) -> str:
    """The per-run directory on the host that holds the env file for the moment of `docker run`."""
    return f"{secrets_dir.rstrip('/')}/eagle-ops-{run_id}-{token}"


def start_command(docker_run: tuple[str, ...], directory: str) -> str:
    """The remote shell text: private directory, 0600 file from stdin, docker run, directory removed on
    any exit (also when the connection drops: HUP). `mkdir` fails on an existing path (never reuses or
    follows one someone else made)."""
    d = shlex.quote(directory)
    # the last line must be END: a connection lost mid-transfer leaves a cut file, and no container
    return (
        f'D={d}; umask 077 && mkdir -- "$D" || exit 125; trap \'rm -rf -- "$D"\' EXIT HUP INT TERM; '
        f'cat > "$D/{ENV_FILE}" && [ "$(tail -n 1 "$D/{ENV_FILE}")" = {shlex.quote(END)} ] && '
        f"{shlex.join(docker_run)}"
    )


class Redactor:
    """Replaces every registered value by MASK."""

    def __init__(self) -> None:
        self._values: set[str] = set()

    def add(self, values: Iterable[str]) -> None:
        self._values |= {v for v in values if v and len(v) >= MIN_REDACT}

    def __call__(self, text: str) -> str:
        for value in sorted(self._values, key=len, reverse=True):  # a value inside a longer one: longer first
            if value in text:
                text = text.replace(value, MASK)
        return text


_REDACTOR = Redactor()
_REDACTOR.add(v for k, v in os.environ.items() if is_secret_name(k))


def protect(values: Iterable[str]) -> None:
    """Register values (beyond the secret-named variables of this process) that no output may show."""
    _REDACTOR.add(values)


def redact(text: str) -> str:
    return _REDACTOR(text)


class RedactingWriter:
    """A text stream in front of others that writes whole lines only, redacted (a value split across two
    chunks of a remote stream is still caught); `close` writes what is left."""

    def __init__(self, *streams: IO[str]) -> None:
        self.streams = streams
        self._pending = ""

    def write(self, text: str) -> None:
        self._pending += text
        cut = max(self._pending.rfind("\n"), self._pending.rfind("\r")) + 1
        if cut:
            self._emit(self._pending[:cut])
            self._pending = self._pending[cut:]

    def _emit(self, text: str) -> None:
        text = redact(text)
        for s in self.streams:
            s.write(text)
            s.flush()

    def flush(self) -> None:
        """Whole lines are already out; a partial line waits for its end (or close)."""

    def close(self) -> None:
        if self._pending:
            self._emit(self._pending)
            self._pending = ""
