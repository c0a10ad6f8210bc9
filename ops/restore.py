"""Bringing the inference server back: the one restore policy, for every command that restores.

Owns when a restore happens and what refuses it: nothing to do when the server already runs or the
strategy is none; a run restores only what it stopped (the server as seen before its stop); never while
a stage container runs on the host (EXIT_BUSY: the server would start on the GPUs the stage holds);
always under the host lock (a run's own, held already; `restore-server` and `attach --restore-server`
take it, waiting up to --wait). `restore` is the one entry point: ops.cli's restore-server, ops.remote_run's
run and attach (each host's of a multi-host run too) call it. The strategies' start steps and running them
are ops.server's (plan_restore, server.restore); turning a failure into an exit code is the CLI's.
"""

from __future__ import annotations

import dataclasses

from rich.console import Console

from ops import server
from ops.connection import Runner
from ops.errors import EXIT_BUSY, OpsError
from ops.gpus import ServerFacts, probe
from ops.hosts import HostConfig
from ops.inventory import stage_containers
from ops.lock import host_lock


def restore(
    runner: Runner,
    host: HostConfig,
    *,
    stopped: ServerFacts | None = None,
    command: str | None = None,
    run_id: str | None = None,
    wait: float = 0.0,
    console: Console | None = None,
) -> list[str]:
    """Bring the server back; the steps done (empty: nothing to do). Either `stopped`: a run's restore of
    what it stopped, as seen before the stop, under the lock the run holds (nothing when the server was not
    running then); or `command`: the command that takes the host lock (waiting up to `wait` s) and restores
    the server as it is now. OpsError: EXIT_BUSY beside a running stage container, EXIT_SERVER_RESTORE when
    starting failed."""
    if (stopped is None) == (command is None):
        raise ValueError("restore: pass exactly one of stopped= (a run's own) and command= (takes the lock)")
    if stopped is not None:
        if not stopped.running:
            return []
        return _unless_a_stage_runs(
            runner, host, dataclasses.replace(stopped, running_container_ids=(), members=())
        )
    with host_lock(runner, host, command, run_id=run_id, wait=wait, console=console):
        return _unless_a_stage_runs(runner, host, probe(runner, host).server)


def _unless_a_stage_runs(runner: Runner, host: HostConfig, facts: ServerFacts) -> list[str]:
    """server.restore, refused while a stage container runs. A server already up, or strategy none, needs no
    refusal: nothing would start."""
    if server.plan_restore(host, facts):
        refuse_beside_stages(runner, host)
    return server.restore(runner, host, facts)


def refuse_beside_stages(runner: Runner, host: HostConfig) -> None:
    """Raise (EXIT_BUSY) when a stage container runs on the host (a detached run, or one whose ops process
    vanished): the server would start on the GPUs the stage holds, and one of them would run out of
    memory hours in. One `docker ps`."""
    for c in stage_containers(runner) or ():
        if c.running:
            raise OpsError(
                f"stage run {c.run_id} (container {c.name}) is running on {host.name}; the server would "
                f"start beside it: `attach {c.run_id} --restore-server` brings it back once the stage "
                f"ends; nothing was started",
                exit_code=EXIT_BUSY,
            )
