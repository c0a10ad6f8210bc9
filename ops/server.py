"""Stopping and restoring the inference server, one strategy per way it can run.

Owns the stop/restore plans (exact argv, or a host-agent request for process groups) for
`container:NAME`, `compose:PROJECT/SERVICE` (containers found by compose's labels, so no compose binary
is needed on the host), `systemd:UNIT`, `pidfile:PATH` (the whole process group is stopped, which also
catches workers re-parented to PID 1 after their API process died) and `none`; running them over a
Runner; and checking that nothing of the server is left. Does not pick GPU holders (ops.gpus/ops.clean).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from ops.agent import call, terminate_request
from ops.connection import Runner
from ops.errors import ConfigError, OpsError, RemoteCommandError
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


def plan_stop(host: HostConfig, facts: ServerFacts) -> StopPlan:
    s, t = host.server, host.timeouts
    if s.kind == "none":
        return StopPlan("none", False, ())
    if s.kind in ("container", "compose"):
        ids = facts.running_container_ids
        if not ids:
            return StopPlan(str(s), False, ())
        targets = (s.target,) if s.kind == "container" else ids
        return StopPlan(str(s), True, (Step("stop server", ("docker", "stop", "--time", str(int(t.stop)), *targets)),))
    if s.kind == "systemd":
        if not facts.members:
            return StopPlan(str(s), False, ())
        return StopPlan(str(s), True, (Step("stop server", ("systemctl", "stop", s.target)),))
    if s.kind == "pidfile":
        if facts.pgid is None or not facts.members:
            return StopPlan(str(s), False, ())
        req = terminate_request([], [facts.pgid], grace=t.stop, kill_wait=t.kill_wait)
        return StopPlan(str(s), True, (Step("stop server process group", agent=req),))
    raise ConfigError(f"unknown strategy {s}")


def plan_restore(host: HostConfig, facts: ServerFacts) -> tuple[Step, ...]:
    """Steps that bring the server back; empty when it already runs or the strategy is none."""
    s = host.server
    if s.kind == "none" or facts.running:
        return ()
    if s.kind == "container":
        return (Step("start server", ("docker", "start", s.target)),)
    if s.kind == "compose":
        if not facts.container_ids:
            raise OpsError(f"no container of compose service {s.target} exists to start; use `docker compose up`")
        return (Step("start server", ("docker", "start", *facts.container_ids)),)
    if s.kind == "systemd":
        return (Step("start server", ("systemctl", "start", s.target)),)
    if s.kind == "pidfile":
        if not host.server_start:
            raise OpsError(f"cannot restore {s}: no `server_start` command in the hosts file")
        # detached from our session (setsid -f) so the server outlives this SSH connection
        return (Step("start server", ("setsid", "-f", *host.server_start)),)
    raise ConfigError(f"unknown strategy {s}")


def run_step(runner: Runner, host: HostConfig, step: Step, *, timeout: float | None = None) -> dict | str:
    if step.agent is not None:
        return call(runner, host, step.agent, timeout=(timeout or 0) + step.agent["grace"] + step.agent["kill_wait"] + 30)
    cmd = shlex.join(step.argv)
    if step.argv[:2] == ("setsid", "-f"):
        cmd += " </dev/null >/dev/null 2>&1"
    res = runner.run(cmd, timeout=timeout or host.timeouts.command)
    if not res.ok:
        raise RemoteCommandError(step.what, cmd, res.exit_code, res.stdout, res.stderr)
    return res.stdout


def stop(runner: Runner, host: HostConfig, facts: ServerFacts) -> StopRecord:
    plan = plan_stop(host, facts)
    record = StopRecord(plan.strategy, plan.running)
    for step in plan.steps:
        out = run_step(runner, host, step, timeout=host.timeouts.stop + 30)
        if isinstance(out, dict):
            record.stopped += [f"pid {r['pid']} ({r['comm']})" for r in out["signalled"]]
            record.survivors += out["survivors"]
        else:
            record.stopped += list(step.argv[4:]) if step.argv[:2] == ("docker", "stop") else [host.server.target]
    return record


def restore(runner: Runner, host: HostConfig, facts: ServerFacts) -> list[str]:
    done = []
    for step in plan_restore(host, facts):
        run_step(runner, host, step)
        done.append(step.show())
    return done
