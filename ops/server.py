"""Stopping and restoring the inference server, one strategy per way it can run.

Owns the stop/restore plans (exact argv, or a host-agent request for process groups) for
`container:NAME`, `compose:PROJECT/SERVICE` (containers found by compose's labels, so no compose binary
is needed on the host), `systemd:UNIT`, `pidfile:PATH` (the whole process group is stopped, which also
catches workers re-parented to PID 1 after their API process died) and `none`; running them over a
Runner; and checking that nothing of the server is left. A server that cannot be found, a stop that
fails or runs past its time, and a start that fails are errors with their own exit codes (ops.errors).
Does not pick GPU holders (ops.gpus/ops.clean).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from ops.agent import call, terminate_request
from ops.connection import Runner
from ops.errors import EXIT_SERVER_RESTORE, EXIT_SERVER_STOP, ConfigError, OpsError, RemoteCommandError
from ops.gpus import ServerFacts
from ops.hosts import HostConfig


@dataclass(frozen=True)
class Step:
    """One action: a shell command line (built from argv) or a host-agent request."""

    what: str
    argv: tuple[str, ...] = ()
    agent: dict | None = None

    def show(self) -> str:
        if self.agent is not None:
            return f"{self.what}: host agent {self.agent['op']} {_brief(self.agent)}"
        return f"{self.what}: {shlex.join(self.argv)}"


def _brief(req: dict) -> str:
    parts = []
    if req.get("targets"):
        parts.append("pids " + " ".join(str(t["pid"]) for t in req["targets"]))
    if req.get("groups"):
        parts.append("process groups " + " ".join(str(g) for g in req["groups"]))
    parts.append(f"(TERM, {req['grace']:g} s, KILL, {req['kill_wait']:g} s)")
    return " ".join(parts)


@dataclass(frozen=True)
class StopPlan:
    strategy: str
    running: bool
    steps: tuple[Step, ...]


@dataclass
class StopRecord:
    """What a stop did, for restore and the report."""

    strategy: str
    was_running: bool
    stopped: list[str] = field(default_factory=list)
    survivors: list[dict] = field(default_factory=list)


def _missing(host: HostConfig, facts: ServerFacts) -> str | None:
    """Why the configured server cannot be found (a typo must not turn its processes into orphans that
    gpu-clean kills one by one); None when it can. A missing pid file is not an error: a stopped server
    removes it."""
    s = host.server
    if s.kind in ("container", "compose", "systemd") and facts.error:
        return f"server {s} on {host.name} cannot be checked: {facts.error}"
    if s.kind == "container" and not facts.container_ids:
        return f"server container {s.target} does not exist on {host.name}"
    if s.kind == "compose" and not facts.container_ids:
        return f"no container of compose service {s.target} exists on {host.name}"
    return None


def _refuse_ours(host: HostConfig, facts: ServerFacts, exit_code: int) -> None:
    """A pid file that points at the operator's own processes (ops, a helper it started, the shell that runs
    it) is refused in one line: nothing of that group is the server's, and nothing is signalled or started."""
    if facts.ours:
        raise OpsError(
            f"the pid file of server {host.server} on {host.name} points at the operator's own processes "
            f"(process group {facts.pgid} holds pid {', '.join(map(str, facts.ours))}: ops, a helper it "
            "started or the shell that runs it); nothing was signalled; put the server's pid in that file, "
            "or fix `server` in the hosts file",
            exit_code=exit_code,
        )


def plan_stop(host: HostConfig, facts: ServerFacts) -> StopPlan:
    s, t = host.server, host.timeouts
    if s.kind == "none":
        return StopPlan("none", False, ())
    missing = _missing(host, facts)
    if missing:
        raise OpsError(
            f"{missing}; fix `server` in the hosts file (`none` if there is no server); nothing was "
            "stopped or signalled",
            exit_code=EXIT_SERVER_STOP,
        )
    if s.kind in ("container", "compose"):
        ids = facts.running_container_ids
        if not ids:
            return StopPlan(str(s), False, ())
        targets = (s.target,) if s.kind == "container" else ids
        return StopPlan(
            str(s), True, (Step("stop server", ("docker", "stop", "--time", str(int(t.stop)), *targets)),)
        )
    if s.kind == "systemd":
        if not facts.members:
            return StopPlan(str(s), False, ())
        return StopPlan(str(s), True, (Step("stop server", ("systemctl", "stop", s.target)),))
    if s.kind == "pidfile":
        _refuse_ours(host, facts, EXIT_SERVER_STOP)
        if facts.pgid is None or not facts.members:
            return StopPlan(str(s), False, ())
        req = terminate_request([], [facts.pgid], grace=t.stop, kill_wait=t.kill_wait)
        # the spared set: every process ops started over this connection, not only the agent's ancestry
        # (a pid file that names, or a group that holds, ops' own helpers must not stop them)
        req["spare_ssh_session"] = not host.is_local
        return StopPlan(str(s), True, (Step("stop server process group", agent=req),))
    raise ConfigError(f"unknown strategy {s}")


def plan_restore(host: HostConfig, facts: ServerFacts) -> tuple[Step, ...]:
    """Steps that bring the server back; empty when it already runs or the strategy is none."""
    s = host.server
    if s.kind == "none" or facts.running:
        return ()
    missing = _missing(host, facts)
    if missing:
        raise OpsError(
            f"{missing}; nothing to start (compose: `docker compose up`)", exit_code=EXIT_SERVER_RESTORE
        )
    if s.kind == "container":
        return (Step("start server", ("docker", "start", s.target)),)
    if s.kind == "compose":
        return (Step("start server", ("docker", "start", *facts.container_ids)),)
    if s.kind == "systemd":
        return (Step("start server", ("systemctl", "start", s.target)),)
    if s.kind == "pidfile":
        _refuse_ours(host, facts, EXIT_SERVER_RESTORE)
        if not host.server_start:
            raise OpsError(
                f"cannot restore {s}: no `server_start` command in the hosts file",
                exit_code=EXIT_SERVER_RESTORE,
            )
        return (Step("start server", ("sh", "-c", START_WATCH, "sh", *host.server_start)),)
    raise ConfigError(f"unknown strategy {s}")


# The pid-file server's start command, in a new session with no terminal and no open pipe to us (so it
# outlives this SSH connection), watched for START_WATCH_S seconds: a command that fails at once is
# reported with its exit code instead of passing for a started server.
START_WATCH_S = 2
START_WATCH = (
    'setsid "$@" </dev/null >/dev/null 2>&1 & pid=$!; sleep ' + str(START_WATCH_S) + "; "
    'if kill -0 "$pid" 2>/dev/null; then exit 0; fi; wait "$pid"; code=$?; '
    '[ "$code" = 0 ] || echo "start command $1 exited $code within '
    + str(START_WATCH_S)
    + ' s" >&2; exit "$code"'
)


def run_step(runner: Runner, host: HostConfig, step: Step, *, timeout: float | None = None) -> dict | str:
    if step.agent is not None:
        return call(
            runner,
            host,
            step.agent,
            timeout=(timeout or 0) + step.agent["grace"] + step.agent["kill_wait"] + 30,
        )
    cmd = shlex.join(step.argv)
    res = runner.run(cmd, timeout=timeout or host.timeouts.command)
    if not res.ok:
        raise RemoteCommandError(step.what, cmd, res.exit_code, res.stdout, res.stderr)
    return res.stdout


def stop(runner: Runner, host: HostConfig, facts: ServerFacts) -> StopRecord:
    """Stop the server; OpsError (EXIT_SERVER_STOP) when it cannot be found, its stop command fails or
    runs past its time, or a process of it survives SIGKILL. Nothing else is signalled after that."""
    plan = plan_stop(host, facts)
    record = StopRecord(plan.strategy, plan.running)
    for step in plan.steps:
        try:
            out = run_step(runner, host, step, timeout=host.timeouts.stop + 30)
        except OpsError as exc:
            raise OpsError(
                f"server {plan.strategy} did not stop: {exc}; no GPU process was signalled",
                exit_code=EXIT_SERVER_STOP,
                detail=exc.detail,
            ) from None
        if isinstance(out, dict):
            record.stopped += [f"pid {r['pid']} ({r['comm']})" for r in out["signalled"]]
            record.survivors += out["survivors"]
        else:
            record.stopped += (
                list(step.argv[4:]) if step.argv[:2] == ("docker", "stop") else [host.server.target]
            )
    if record.survivors:
        left = ", ".join(f"{r['pid']} {r['comm']} state {r['state']}" for r in record.survivors)
        raise OpsError(
            f"server {plan.strategy} did not stop: {left} survived SIGTERM and SIGKILL "
            f"({host.timeouts.stop:g} s + {host.timeouts.kill_wait:g} s), reboot needed; no other GPU "
            "process was signalled",
            exit_code=EXIT_SERVER_STOP,
        )
    return record


def restore(runner: Runner, host: HostConfig, facts: ServerFacts) -> list[str]:
    """Start the server again; OpsError (EXIT_SERVER_RESTORE) when that fails."""
    done = []
    for step in plan_restore(host, facts):
        try:
            run_step(runner, host, step)
        except OpsError as exc:
            raise OpsError(
                f"server {host.server} was not restored: {exc}",
                exit_code=EXIT_SERVER_RESTORE,
                detail=exc.detail,
            ) from None
        done.append(step.show())
    return done
