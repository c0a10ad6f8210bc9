"""Rendering for people (rich tables) and machines (JSON) of what ops found and did.

Owns every table and summary line ops prints; nothing else formats output. Takes facts and reports,
returns nothing but output on the given console.
"""

from __future__ import annotations

import dataclasses
import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from contract.summary import provenance_facts, schema_note
from ops.clean import CleanPlan, CleanReport
from ops.gpus import GpuState, Holder
from ops.secret_env import redact

STYLE = {"protected": "green", "server": "yellow", "orphan": "red"}


def to_jsonable(obj):
    if dataclasses.is_dataclass(obj):
        return {k: to_jsonable(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    return obj


def dumps(obj) -> str:
    """JSON for --json output; values of the operator's secrets redacted (a holder's command line may
    carry one)."""
    return redact(json.dumps(to_jsonable(obj), indent=2, sort_keys=True))


def _holder_row(h: Holder) -> list[str]:
    mem = "" if h.used_mib is None else f"{h.used_mib}"
    return [
        str(h.proc.pid),
        h.proc.comm,
        h.proc.user,
        h.proc.container or "",
        f"[{STYLE[h.klass]}]{h.klass}[/]",
        h.reason,
        mem,
        h.via,
        h.proc.state,
    ]


def _holders_table(title: str, holders: list[Holder]) -> Table:
    t = Table(title=title, title_justify="left")
    for col in ("PID", "name", "user", "container", "class", "why", "MiB", "seen by", "state"):
        t.add_column(col)
    for h in holders:
        t.add_row(*_holder_row(h))
    return t


def print_status(console: Console, state: GpuState) -> None:
    console.print(
        f"[bold]{state.host}[/] ({state.hostname}): {len(state.gpus)} GPU(s), "
        f"{len(state.device_files)} device file(s), server {_server_line(state)}"
    )
    if state.gpu_error:
        console.print(f"[red]GPU facts unavailable:[/] {state.gpu_error}")
    if state.fuser_error:
        console.print(f"[red]device-file holders unavailable:[/] {state.fuser_error}")
    for g in state.gpus:
        util = "n/a" if g.util_gpu is None else f"{g.util_gpu}%"
        title = (
            f"GPU {g.index} {g.name}: {g.memory_used_mib}/{g.memory_total_mib} MiB used "
            f"(NVML {g.memory_api}), util {util}"
        )
        console.print(_holders_table(title, [h for h in state.holders if g.index in h.gpus]))
    others = [h for h in state.holders if not h.gpus]
    if others:
        console.print(_holders_table("holding device files only (no NVML compute process)", others))


def _server_line(state: GpuState) -> str:
    s = state.server
    if s.kind == "none":
        return "strategy none"
    what = "running" if s.running else "not running"
    if s.ours:
        what = f"the pid file points at the operator's own processes ({', '.join(map(str, s.ours))})"
    if s.error:
        what += f" ({s.error})"
    return f"{s.kind}: {what}"


def print_plan(console: Console, plan: CleanPlan) -> None:
    console.print("[bold]plan[/]")
    if not plan.stop.steps:
        console.print(f"  server: nothing to stop ({plan.stop.strategy})")
    for step in plan.stop.steps:
        console.print(f"  1. {step.show()}")
    if plan.kill_step is not None:
        console.print(f"  2. {plan.kill_step.show()}; only those still running after step 1")
        for h in plan.kill:
            console.print(f"     - {h.proc.pid} {h.proc.comm} [{STYLE[h.klass]}]{h.klass}[/] ({h.reason})")
    else:
        console.print("  no GPU holder to terminate")
    for h in plan.spare:
        console.print(f"  spare {h.proc.pid} {h.proc.comm} ({h.reason})")
    console.print("  3. verify: no compute process and used memory under the threshold on every GPU")


def print_clean(console: Console, report: CleanReport) -> None:
    print_plan(console, report.plan)
    if report.dry_run:
        console.print("[bold]dry run[/]: nothing was stopped or signalled")
        return
    if report.stopped and report.stopped.was_running:
        console.print(f"stopped server {report.stopped.strategy}: {', '.join(report.stopped.stopped) or '-'}")
    for s in report.signalled:
        console.print(f"signalled {s['pid']} {s['comm']}: {' then '.join(s['signals'])}")
    for s in report.skipped:
        console.print(f"skipped {s['pid']}: {s['reason']}")
    for r in report.respawned:
        console.print(
            f"came back: {r['pid']} {r['comm']} (parent {r['ppid']}) after kill round {r['after_round']}"
        )
    for d in report.denied:
        console.print(f"cannot signal {d['pid']} {d['comm']} (user {d['user']}): {d['error']}")
    for c in report.checks:
        mark = "[green]ok[/]" if c.ok else "[red]busy[/]"
        console.print(f"GPU {c.index}: {mark} {c.reason}")
    if report.survivors:
        pids = ", ".join(f"{s['pid']} {s['comm']} state {s['state']}" for s in report.survivors)
        console.print(f"[bold red]unkillable: reboot needed[/]: {pids}")
    elif report.verdict == "clean":
        nothing = report.plan.empty
        console.print("[bold green]clean[/]" + (" (nothing to do)" if nothing else ""))
    elif report.detail:
        console.print(f"[bold red]{report.verdict}[/]: {redact(report.detail)}")
    else:
        console.print(f"[bold red]{report.verdict}[/]")
    console.print(f"gpu-clean took {report.elapsed_s:.1f} s, {report.rounds} kill round(s)")


def print_fanout(console: Console, merged: dict, local_dir) -> None:
    """A multi-host run: one row per host (status, exit code, files, tokens, seconds, error), then the
    totals over all shards."""
    t = Table(
        title=f"{merged['stage']} on {merged['world_size']} hosts ({local_dir}/summary.json)",
        title_justify="left",
    )
    for col in ("host", "rank", "status", "exit", "files", "tokens", "seconds", "error"):
        t.add_column(col)
    colour = {"ok": "green", "skipped": "cyan", "failed": "red"}
    for h in merged["hosts"]:
        st = h["status"] + (" (complete)" if h["status"] == "skipped" else "")
        t.add_row(
            escape(h["host"]),
            str(h["rank"]),
            f"[{colour.get(h['status'], 'red')}]{st}[/]",
            "" if h.get("exit_code") is None else str(h["exit_code"]),
            str(h.get("files") or 0),
            f"{h.get('tokens') or 0:,}",
            f"{h.get('seconds') or 0:.1f}",
            escape(h.get("error") or ""),
        )
    console.print(t)
    tot = merged["totals"]
    missing = tot["missing_files"]
    line = (
        f"{tot['files']} of {tot['samples'] if tot['samples'] is not None else '?'} files, "
        f"{tot['tokens']:,} tokens; complete ranks {tot['complete_ranks'] or '-'}"
    )
    if merged["complete"]:
        console.print(f"[green]all {merged['world_size']} shards complete[/]: {line}")
    else:
        shown = ", ".join(f"data_{i}" for i in missing[:8]) + (
            f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
        )
        console.print(
            f"[red]incomplete[/]: {line}; incomplete ranks {tot['incomplete_ranks']}"
            + (f"; missing {shown}" if missing else "")
            + (f"; ranks with unknown state {tot['unknown_ranks']}" if tot["unknown_ranks"] else "")
            + "; run the same command again to redo only those hosts"
        )
    differ = tot.get("provenance_disagree") or []
    if differ:
        console.print(
            f"[yellow]the hosts' outputs were not made alike: they differ in {', '.join(differ)}[/] "
            "(each host's summary.json says how it was made)"
        )
    for h in merged["hosts"]:
        if h.get("schema_note"):
            console.print(f"[yellow]{escape(h['host'])}: {escape(h['schema_note'])}[/]")


def print_checks(console: Console, checks, title: str = "preflight") -> None:
    t = Table(title=title, title_justify="left")
    for col in ("check", "status", "detail"):
        t.add_column(col)
    colour = {"ok": "green", "warn": "yellow", "fail": "red"}
    for c in checks:
        t.add_row(c.name, f"[{colour[c.status]}]{c.status}[/]", c.detail)
    console.print(t)


def print_summary(console: Console, summary: dict | None, exit_code: int | None, local_dir) -> None:
    """The fetched summary.json as a table: its checks, then its other scalar fields."""
    if summary is None:
        console.print(f"no summary.json fetched; logs in {local_dir}/stage.log")
    else:
        t = Table(title=f"summary ({local_dir}/summary.json)", title_justify="left")
        for col in ("check", "status", "detail"):
            t.add_column(col)
        for c in summary.get("checks", []):
            st = str(c.get("status", ""))
            t.add_row(
                str(c.get("name", "")),
                f"[{'green' if st == 'ok' else 'red'}]{st}[/]",
                str(c.get("detail", "")),
            )
        for k, v in summary.items():
            if k != "checks" and (v is None or isinstance(v, (str, int, float, bool))):
                t.add_row(k, "", str(v))
        console.print(t)
        note = schema_note(summary)
        facts = provenance_facts(summary)
        if note:
            console.print(f"[yellow]{note}[/]", markup=True)
        elif any(facts.values()):
            console.print(
                "made by eagle-ops " + ", ".join(f"{k} {v}" for k, v in facts.items() if v), markup=False
            )
    colour = "green" if exit_code == 0 else "red"
    console.print(f"[{colour}]stage exit code {exit_code}[/]")


def server_line(host, plan) -> str:
    """What the run does to the host's inference server (contract.stages: stopped, up or kept)."""
    if plan.stops_server:
        return (
            "stopped and the GPUs freed and proven clean (gpu-clean) before the stage; restored at the end "
            "with --restore-server"
        )
    if not plan.server_up:
        return (
            f"left as it is: never stopped, no gpu-clean, nothing to restore ({plan.stage} uses no GPU and "
            "no server)"
        )
    model = f", model {host.served_model}" if host.served_model else ""
    return (
        "stays up: never stopped, no gpu-clean, nothing to restore; the stage (no GPUs) asks it at "
        f"{host.server_endpoint}{model} on the host's network (--network host)"
    )


def print_stage_plan(console: Console, host, plan) -> None:
    """remote-run --dry-run: the exact docker run argv and which secrets would travel (names only)."""
    import shlex

    from ops.layout import describe
    from ops.stage import STAGES

    console.print(f"[bold]plan[/] {plan.stage} on {host.name}, run id {plan.run_id}")
    console.print(f"  stage: {shlex.join(plan.stage_argv)}", markup=False)
    if STAGES[plan.stage].layout:
        console.print(f"  layout: {describe(host.layout, plan.layout)}", markup=False)
    for line in plan.train.why if plan.train is not None else ():
        console.print(f"  {line}", markup=False)
    console.print(f"  server {host.server}: {server_line(host, plan)}", markup=False)
    console.print(f"  preflight in the image: {plan.preflight_run[-1]}", markup=False)
    if plan.secret_names:
        console.print(
            f"  secrets: {', '.join(plan.secret_names)} (values through a 0600 env file in "
            f"{plan.env_dir}, removed once the container started)"
        )
    else:
        console.print("  secrets: none")
    missing = [n for n in host.secrets if n not in plan.secret_names]
    if missing:
        console.print(f"  not set on this machine (not passed): {', '.join(missing)}")
    console.print(f"  {shlex.join(plan.docker_run)}", markup=False)
    console.print("[bold]dry run[/]: nothing was checked, stopped or started")
