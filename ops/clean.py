"""gpu-clean: stop the server, free the GPUs narrowly, prove them clean.

Owns the clean plan (what would be stopped, who gets SIGTERM then SIGKILL, who is spared and why) and
running it: server stop by strategy, then the remaining non-protected holders through the host agent
(by pid + start time, never our ancestry), then the verify-clean loop. Returns a report with a verdict;
the CLI maps verdicts to exit codes. Does not print.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ops import server
from ops.agent import terminate_request
from ops.connection import Runner
from ops.gpus import ORPHAN, PROTECTED, SERVER, GpuCheck, GpuState, Holder, check_clean, probe
from ops.hosts import HostConfig
from ops.server import Step, StopPlan

CLEAN, UNKILLABLE, NOT_CLEAN = "clean", "unkillable: reboot needed", "not clean"


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
        req = terminate_request([(h.proc.pid, h.proc.starttime) for h in kill], [],
                                grace=host.timeouts.grace, kill_wait=host.timeouts.kill_wait)
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
    after: GpuState | None = None
    checks: list[GpuCheck] = field(default_factory=list)
    verdict: str = ""


def verify_clean(runner: Runner, host: HostConfig, *, timeout: float,
                 first: GpuState | None = None) -> tuple[GpuState, list[GpuCheck]]:
    """Probe until every GPU is clean or the timeout passes; the last state and checks. `first` is a
    probe taken just now, used as the first attempt."""
    deadline = time.monotonic() + timeout
    while True:
        state, first = first or probe(runner, host), None
        checks = check_clean(state, host.clean_threshold_mib)
        if all(c.ok for c in checks) or time.monotonic() >= deadline:
            return state, checks
        time.sleep(1.0)


def gpu_clean(runner: Runner, host: HostConfig, *, dry_run: bool = False, before: GpuState | None = None,
              on_step: Callable[[str], None] = lambda step: None) -> CleanReport:
    """`before`: a probe the caller took moments ago (remote-run's preflight), to save a round trip.
    `on_step("clean")` is called once the server is down, before any GPU holder is signalled."""
    before = before or probe(runner, host)
    plan = plan_clean(before, host)
    report = CleanReport(before, plan, dry_run=dry_run)
    if dry_run:
        return report
    if plan.stop.steps:
        report.stopped = server.stop(runner, host, before.server)
        report.survivors += report.stopped.survivors
    on_step("clean")
    # who still holds a GPU once the server is down (its processes should be gone by now)
    now = probe(runner, host) if plan.stop.steps else before
    again = plan_clean(now, host)
    if again.kill_step is not None:
        out = server.run_step(runner, host, again.kill_step)
        assert isinstance(out, dict)
        report.signalled, report.skipped = out["signalled"], out["skipped"]
        report.survivors += out["survivors"]
    if report.survivors:
        report.after = probe(runner, host)
        report.checks = check_clean(report.after, host.clean_threshold_mib)
        report.verdict = UNKILLABLE
        return report
    fresh = now if again.kill_step is None and plan.stop.steps else None
    report.after, report.checks = verify_clean(runner, host, timeout=host.timeouts.clean, first=fresh)
    report.verdict = CLEAN if all(c.ok for c in report.checks) else NOT_CLEAN
    return report
