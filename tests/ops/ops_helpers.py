"""Helpers shared by the ops tests: hosts files, running the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ops_sshd import Sshd

REPO = Path(__file__).resolve().parents[2]


def write_hosts(path: Path, name: str, **table) -> Path:
    """Write a hosts file with one [hosts.NAME] table (values in TOML)."""
    lines = [f"[hosts.{name}]"]
    sub = {}
    for key, value in table.items():
        if isinstance(value, dict):
            sub[key] = value
            continue
        lines.append(f"{key} = {toml_value(value)}")
    for key, value in sub.items():
        lines.append(f"[hosts.{name}.{key}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in value.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def toml_value(value) -> str:
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def ssh_table(sshd: Sshd, known_hosts: Path, **extra) -> dict:
    """A host reached through the test sshd; its host lock lies beside known_hosts (one per test folder,
    so tests of other checkouts on this machine never contend for /run/lock/eagle-ops.lock)."""
    extra.setdefault("lock_file", str(known_hosts.parent / "eagle-ops.lock"))
    return dict(
        host="127.0.0.1",
        port=sshd.port,
        user=sshd.user,
        key=str(sshd.user_key),
        known_hosts=str(known_hosts),
        python="/usr/bin/python3",
        **extra,
    )


def loopback_hosts(
    path: Path,
    name: str,
    sshd: Sshd,
    server: str,
    devdir: Path,
    table: Path,
    image: tuple[str, list[str]],
    data: Path,
    model: Path | None,
    timeouts: dict,
    **extra,
) -> Path:
    """The hosts file of a loopback 'GPU host': reached through the test sshd, its server the container
    `server` (or a whole strategy, `pidfile:/…`) holding devdir's GPU (listed in the GPU table `table`), the
    stage image and its mounts, data root `data` (cache inside it), the target `model` (None: the default),
    and `extra` keys over these."""
    tag, mounts = image
    table_ = ssh_table(
        sshd,
        sshd.write_known_hosts(path.parent / "known_hosts"),
        server=server if ":" in server else f"container:{server}",
        device_glob=f"{devdir}/nvidia*",
        gpu_source=f"table:{table}",
        image=tag,
        docker_gpus="",
        mounts=mounts,
        data_root=str(data),
        cache_dir=str(data / "cache"),
        timeouts=timeouts,
        **({"model_dir": str(model)} if model is not None else {}),
    )
    return write_hosts(path, name, **{**table_, **extra})


def run_ops(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python -m ops ARGS` as the operator would, from the repo root."""
    full_env = dict(os.environ, COLUMNS="200", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "ops", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )


class OpsProcess:
    """`python -m ops ARGS` running in the background (stdout and stderr into files), for tests that
    signal it or run a second command beside it."""

    def __init__(self, folder: Path, name: str, *args: str, env: dict | None = None) -> None:
        self.out, self.err = folder / f"{name}.out", folder / f"{name}.err"
        full_env = dict(os.environ, COLUMNS="200", **(env or {}))
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ops", *args], cwd=REPO, stdout=out, stderr=err, env=full_env
            )

    def text(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def wait_for(self, text: str, timeout: float = 180) -> None:
        """Until `text` is in its output (fails at once if it exits first)."""
        import time

        deadline = time.monotonic() + timeout
        while text not in self.text():
            assert self.proc.poll() is None, f"exited {self.proc.returncode} before {text!r}: {self.text()}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s: {self.text()}"
            time.sleep(0.05)

    def finish(self, timeout: float = 300) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def lock_is_free(path: Path) -> bool:
    """Whether nobody holds the host lock file's flock (tested by taking and dropping it)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def lock_record(path: Path) -> dict | None:
    """The holder record in a host lock file (its keeper's pid among it), None when empty."""
    import json

    text = path.read_text() if path.exists() else ""
    return json.loads(text) if text else None
