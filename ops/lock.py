"""The host lock: one changing ops command at a time per GPU host, and no stage run twice.

Owns taking and releasing the lock ON THE HOST: an flock on the host's `lock_file`, held by a keeper
process (ops/host/lock.py) that ops starts over its own connection and that lives exactly as long as
the ops command (released on exit, error, Ctrl-C, a dropped SSH connection, or a heartbeat missing for
`timeouts.lock_expire` seconds); the holder record a refused operator is shown (who, which command and
run, since when) and the advice that goes with it; and the stage checks that run under the lock (a
stage container of the same output must be attached, not started a second time; one that holds GPUs
must not be killed by gpu-clean as an orphan). Does not decide which commands lock: ops.cli and
ops.remote_run do.
"""

from __future__ import annotations

import functools
import getpass
import json
import shlex
import socket
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from rich.console import Console

from ops.connection import Process, Runner
from ops.errors import EXIT_BUSY, OpsError
from ops.hosts import HostConfig
from ops.interrupts import pause_point
from ops.gpus import GpuState
from ops.inventory import stage_containers


@functools.cache
def keeper_source() -> str:
    return (Path(__file__).parent / "host" / "lock.py").read_text()


def keeper_command(host: HostConfig) -> str:
    return shlex.join([host.python, "-c", keeper_source()])


def operator() -> str:
    """Who runs this ops command, as the refused operator will read it: local user@machine."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    return f"{user}@{socket.gethostname()}"


def lock_request(host: HostConfig, command: str, run_id: str | None, wait: float) -> dict:
    return {
        "path": host.lock_file,
        "wait": wait,
        "expire": host.timeouts.lock_expire,
        "record": {"operator": operator(), "command": command, "run_id": run_id},
    }


def describe(record: dict | None) -> str:
    """`remote-extract (run R) by alice@laptop as root since T (lock pid N)`."""
    if not record:
        return "another ops command (no holder record yet)"
    run = f" (run {record['run_id']})" if record.get("run_id") else ""
    who = f"{record.get('operator', '?')} as {record.get('ssh_user', '?')}"
    return (
        f"{record.get('command', '?')}{run} by {who} "
        f"since {record.get('since', '?')} (lock pid {record.get('pid', '?')})"
    )


@dataclass
class HostLock:
    """A held lock: its keeper on the host and the heartbeat that keeps it."""

    host: HostConfig
    proc: Process
    record: dict

    def ensure(self) -> None:
        """Raise if the keeper is gone (heartbeat lost while this process was frozen)."""
        if self.proc.exited():
            raise OpsError(
                f"lost the host lock on {self.host.name} (its keeper exited); stopping here",
                exit_code=EXIT_BUSY,
            )


def _heartbeat(proc: Process, interval: float, stop: threading.Event) -> None:
    while not stop.wait(interval):
        try:
            proc.write("\n")
        except Exception:  # the keeper or the connection is gone; ensure() reports it
            return


@contextmanager
def host_lock(
    runner: Runner,
    host: HostConfig,
    command: str,
    *,
    run_id: str | None = None,
    wait: float = 0.0,
    console: Console | None = None,
) -> Iterator[HostLock]:
    """Hold the host lock for the body; refuse (OpsError, exit EXIT_BUSY) naming the holder, or wait up
    to `wait` seconds for it."""
    proc = runner.start(keeper_command(host))
    stop = threading.Event()
    try:
        try:
            proc.write(json.dumps(lock_request(host, command, run_id, wait)) + "\n")
        except (OSError, EOFError):
            pass  # the keeper did not start: its stderr says why (below)
        threading.Thread(
            target=_heartbeat, args=(proc, host.timeouts.lock_expire / 4, stop), daemon=True
        ).start()
        reply = _answer(proc, host, wait, console)
        pause_point("locked")
        yield HostLock(host, proc, reply["record"])
    finally:
        stop.set()
        proc.close()


def _answer(proc: Process, host: HostConfig, wait: float, console: Console | None) -> dict:
    while True:
        line = proc.readline(timeout=wait + host.timeouts.command)
        if not line:
            err = proc.stderr().strip().splitlines()
            raise OpsError(
                f"cannot take the host lock {host.lock_file} on {host.name}: "
                f"{err[-1] if err else 'the lock keeper exited without an answer'}"
            )
        msg = json.loads(line)
        if msg["state"] == "held":
            return msg
        if msg["state"] == "waiting" and console is not None:
            console.print(f"{host.name} is busy: {describe(msg['holder'])}; waiting up to {wait:g} s")
        elif msg["state"] == "busy":
            raise OpsError(
                f"{host.name} is busy: {describe(msg['holder'])}; wait for it to finish, or pass "
                f"--wait SECONDS",
                exit_code=EXIT_BUSY,
            )


def refuse_duplicate_run(runner: Runner, host: HostConfig, output: str) -> None:
    """Raise (EXIT_BUSY) when a stage container of `output` exists on the host, running or finished but
    not collected (an SSH drop leaves it so): it is to be attached, not run a second time. Without docker
    there is nothing to check (preflight reports docker itself)."""
    for c in stage_containers(runner) or ():
        if c.output == output:
            what = "being written by" if c.running else f"the output of the uncollected ({c.state})"
            raise OpsError(
                f"{output} on {host.name} is {what} run {c.run_id} (container {c.name}); "
                f"`attach {c.run_id}` to follow and collect it",
                exit_code=EXIT_BUSY,
            )


def refuse_killing_stages(runner: Runner, host: HostConfig, state: GpuState) -> None:
    """Raise (EXIT_BUSY) when a GPU holder runs in a stage container (a detached run, or one whose ops
    process vanished): gpu-clean would kill it as an orphan. One `docker ps`, only when some holder runs
    in a container at all."""
    in_containers = {h.proc.container_id for h in state.holders if h.proc.container_id}
    if not in_containers:
        return
    for c in stage_containers(runner) or ():
        if c.running and c.id in in_containers:
            raise OpsError(
                f"stage run {c.run_id} (container {c.name}) holds GPUs on {host.name}; `attach {c.run_id}` "
                f"to follow it, or `docker stop {c.name}` first; nothing was stopped or signalled",
                exit_code=EXIT_BUSY,
            )
