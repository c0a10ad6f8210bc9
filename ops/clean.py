"""gpu-clean: stop the server, free the GPUs narrowly, prove them clean.

Owns the clean plan (what would be stopped, who gets SIGTERM then SIGKILL, who is spared and why) and
running it: server stop by strategy, then the remaining non-protected holders through the host agent
(by pid + start time, never our ancestry) in bounded rounds (a holder restarted by a supervisor is
recognised and its parent named, never killed), then the verify-clean loop. Returns a report with a
verdict (clean, unkillable, cannot signal, respawned, not clean); VERDICT_EXIT maps verdicts to exit
codes for the CLI. Does not print.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ops import server
from ops.agent import terminate_request
from ops.connection import Runner
from ops.errors import EXIT_CANNOT_SIGNAL, EXIT_NOT_CLEAN, EXIT_OK, EXIT_RESPAWNED, EXIT_UNKILLABLE
from ops.gpus import (
    ORPHAN,
    PROTECTED,
    SERVER,
    GpuCheck,
    GpuState,
    Holder,
    check_clean,
    probe,
    refuse_lasting,
)
from ops.hosts import HostConfig
from ops.server import Step, StopPlan

CLEAN, UNKILLABLE, NOT_CLEAN = "clean", "unkillable: reboot needed", "not clean"
RESPAWNED, CANNOT_SIGNAL = "respawned by a supervisor", "cannot signal: permission denied"
#: the exit code of each verdict (table in ops.errors)
VERDICT_EXIT = {
    CLEAN: EXIT_OK,
    UNKILLABLE: EXIT_UNKILLABLE,
    NOT_CLEAN: EXIT_NOT_CLEAN,
    RESPAWNED: EXIT_RESPAWNED,
    CANNOT_SIGNAL: EXIT_CANNOT_SIGNAL,
}
MAX_ROUNDS = 3  # kill rounds before holders that keep coming back are reported as respawned
SETTLE_S = 1.0  # after a kill round, one more probe this much later, so that a prompt restart shows


@dataclass(frozen=True)
class CleanPlan:
    stop: StopPlan
    kill: tuple[Holder, ...]  # non-protected holders now; re-read after the server stop
    spare: tuple[Holder, ...]
    kill_step: Step | None

    @property
    def empty(self) -> bool:
        return not self.stop.steps and not self.kill


def plan_clean(state: GpuState, host: HostConfig) -> CleanPlan:
    kill = tuple(h for h in state.holders if h.klass in (SERVER, ORPHAN))
    spare = tuple(h for h in state.holders if h.klass == PROTECTED)
    stop = server.plan_stop(host, state.server)
    step = None
    if kill:
        req = terminate_request(
            [(h.proc.pid, h.proc.starttime) for h in kill],
            [],
            grace=host.timeouts.grace,
            kill_wait=host.timeouts.kill_wait,
        )
        step = Step("free GPUs", agent=req)
    return CleanPlan(stop, kill, spare, step)


@dataclass
class CleanReport:
    before: GpuState
    plan: CleanPlan
    dry_run: bool = False
    stopped: server.StopRecord | None = None
    signalled: list[dict] = field(default_factory=list)
    survivors: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    denied: list[dict] = field(default_factory=list)  # holders we may not signal (EPERM)
    rounds: int = 0  # kill rounds run
    respawned: list[dict] = field(default_factory=list)  # holders that appeared after a kill round
    supervisors: list[dict] = field(default_factory=list)  # the parents that restarted them
    after: GpuState | None = None
    checks: list[GpuCheck] = field(default_factory=list)
    verdict: str = ""
    detail: str = ""  # the verdict in words, naming pids (respawned by, cannot signal)
    elapsed_s: float = 0.0  # gpu-clean's own time, from the first probe to the verdict


def verify_clean(
    runner: Runner, host: HostConfig, *, timeout: float, first: GpuState | None = None
) -> tuple[GpuState, list[GpuCheck]]:
    """Probe until every GPU is clean or the timeout passes; the last state and checks. `first` is a
    probe taken just now, used as the first attempt. A GPU fact source that is not there at all is no busy
    GPU: OpsError (exit 6) at the probe that finds it, not after the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        state, first = first or probe(runner, host), None
        refuse_lasting(state, after="")
        checks = check_clean(state, host.clean_threshold_mib)
        if all(c.ok for c in checks) or time.monotonic() >= deadline:
            return state, checks
        time.sleep(1.0)


def _ident(h: Holder) -> tuple[int, int]:
    return h.proc.pid, h.proc.starttime


def _supervisors(state: GpuState, holders: list[Holder]) -> list[dict]:
    """The parents of holders that came back: who restarts them (never signalled by us)."""
    known = {p.pid: p for p in state.parents} | {h.proc.pid: h.proc for h in state.holders}
    out = []
    for ppid in sorted({h.proc.ppid for h in holders}):
        p = known.get(ppid)
        out.append({"pid": ppid, "comm": p.comm if p else "?", "cmdline": p.cmdline if p else "?"})
    return out


def _kill_rounds(runner: Runner, host: HostConfig, state: GpuState, report: CleanReport) -> GpuState:
    """Terminate every non-protected holder; one that appears after a round (a new pid or start time:
    something restarted it) gets another round, at most MAX_ROUNDS in all, then the verdict names its
    parent. After the last round one more probe SETTLE_S later catches a restart that takes a moment.
    Stops at once on a survivor of SIGKILL or a holder we may not signal. Returns the last probe."""
    seen: set[tuple[int, int]] = set()
    settled = True
    while True:
        kill = [h for h in state.holders if h.klass in (SERVER, ORPHAN)]
        if not kill:
            if settled:
                return state
            time.sleep(SETTLE_S)
            state, settled = probe(runner, host), True
            continue
        fresh = [h for h in kill if _ident(h) not in seen]
        if report.rounds:
            report.respawned += [
                {
                    "pid": h.proc.pid,
                    "comm": h.proc.comm,
                    "ppid": h.proc.ppid,
                    "devices": list(h.proc.devices),
                    "after_round": report.rounds,
                }
                for h in fresh
            ]
        if report.rounds >= MAX_ROUNDS:
            report.supervisors = _supervisors(state, fresh or kill)
            report.verdict = RESPAWNED
            report.detail = "; ".join(
                f"pid {s['pid']} ({s['comm']}: {' '.join(s['cmdline'].split())[:100]})"
                for s in report.supervisors
            )
            return state
        report.rounds += 1
        req = terminate_request(
            [_ident(h) for h in kill], [], grace=host.timeouts.grace, kill_wait=host.timeouts.kill_wait
        )
        out = server.run_step(runner, host, Step("free GPUs", agent=req))
        assert isinstance(out, dict)
        report.signalled += out["signalled"]
        report.skipped += out["skipped"]
        report.survivors += out["survivors"]
        report.denied += out.get("denied", [])
        seen |= {_ident(h) for h in kill}
        if report.survivors or report.denied:
            return state
        state, settled = probe(runner, host), False


def gpu_clean(
    runner: Runner,
    host: HostConfig,
    *,
    dry_run: bool = False,
    before: GpuState | None = None,
    on_step: Callable[[str], None] = lambda step: None,
) -> CleanReport:
    """`before`: a probe the caller took moments ago (remote-run's preflight), to save a round trip.
    `on_step("clean")` is called once the server is down, before any GPU holder is signalled. OpsError (exit
    6) at once when the GPU fact source is not there at all (ops.gpus.refuse_lasting)."""
    started = time.monotonic()
    before = before or probe(runner, host)
    refuse_lasting(before)  # no GPU facts to prove anything by: nothing is stopped or signalled
    plan = plan_clean(before, host)
    report = CleanReport(before, plan, dry_run=dry_run)
    if dry_run:
        return report
    try:
        if plan.stop.steps:
            report.stopped = server.stop(runner, host, before.server)
            report.survivors += report.stopped.survivors
        on_step("clean")
        # who still holds a GPU once the server is down (its processes should be gone by now)
        now = probe(runner, host) if plan.stop.steps else before
        if not report.survivors:
            now = _kill_rounds(runner, host, now, report)
        if report.survivors:
            report.verdict = UNKILLABLE
        elif report.denied:
            report.verdict = CANNOT_SIGNAL
            report.detail = "; ".join(
                f"pid {d['pid']} ({d['comm']}, user {d['user']}): {d['signal']}: {d['error']}"
                f" (we run as uid {d['as_uid']})"
                for d in report.denied
            )
        if report.verdict:  # unkillable, cannot signal, respawned: no point waiting for the GPUs
            report.after = probe(runner, host)
            report.checks = check_clean(report.after, host.clean_threshold_mib)
            return report
        fresh = now if report.rounds or plan.stop.steps else None
        report.after, report.checks = verify_clean(runner, host, timeout=host.timeouts.clean, first=fresh)
        report.verdict = CLEAN if all(c.ok for c in report.checks) else NOT_CLEAN
        return report
    finally:
        report.elapsed_s = round(time.monotonic() - started, 3)
