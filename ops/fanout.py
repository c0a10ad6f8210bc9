"""Several hosts, one sharded stage: `--host a,b,c` for remote-extract and remote-run extract|verify.

Owns the shard plan (host i of N runs the stage with `--world-size N --rank i`, under the same run id,
into the same output path on its own disk), running each host's ordinary remote_run flow in its own
thread on its own connection with its output lines prefixed by the host name, the merged record
runs/<run-id>/summary.json (one section per host, totals, complete ranks, missing files), and the re-run
rule: running the same run id again skips the hosts whose shard verified complete and resumes the
others. A failing host becomes a row of the result, never an exception that stops the other hosts.

Planning (`plan_fanout`), merging (`merge`) and the exit code (`exit_code`) are pure; `run_fanout` is the
thin runner. It does not turn anything into an exit code (ops.cli does) and does not format tables
(ops.report does).
"""

from __future__ import annotations

import json
import shlex
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

from rich.console import Console

from contract.shards import shard
from contract.summary import disagreements, provenance_facts, schema_note
from ops.errors import EXIT_HOSTS_FAILED, EXIT_INTERRUPTED, ConfigError, OpsError
from ops.hosts import HostConfig
from ops.interrupts import interrupt_thread
from ops.layout import known
from ops.remote_run import remote_run
from ops.request import RunRequest
from ops.runstate import run_dir, write_json
from ops.secret_env import available, env_file_text
from ops.stage import StagePlan, new_run_id, plan_stage, stage_arguments
from ops.stageargs import StageArgs, parse

SHARDED = ("extract", "verify")  # stages whose pipeline command takes --world-size/--rank
KIND = "fanout"  # runs/<run-id>/summary.json of a multi-host run says so
SUMMARY = "summary.json"
OWN_FLAGS = ("--world-size", "--rank", "--out")  # set by the plan, never by the operator
OK, SKIPPED, FAILED, RUNNING = "ok", "skipped", "failed", "running"


@dataclass(frozen=True)
class HostJob:
    """One host's part of the run."""

    host: HostConfig
    rank: int
    world_size: int
    plan: StagePlan
    skip: str | None = None  # why this host does not run (its shard is already complete)


@dataclass(frozen=True)
class FanoutPlan:
    run_id: str
    stage: str
    world_size: int
    extra: tuple[str, ...]  # the operator's stage arguments (without --world-size/--rank)
    jobs: tuple[HostJob, ...]
    previous: dict | None = None  # the merged record of an earlier attempt of this run id

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(j.host.name for j in self.jobs)


@dataclass
class HostResult:
    """What one host did, as data."""

    host: str
    rank: int
    status: str  # ok | skipped | failed | running (in a record written while other hosts still run)
    exit_code: int | None = None
    error: str = ""
    seconds: float = 0.0
    summary: dict | None = None
    previous: dict | None = None  # the earlier section of a skipped host


# ---------------------------------------------------------------- planning (pure)


def shard_complete(summary: dict | None, world_size: int, rank: int) -> bool:
    """True when a host's fetched summary says its shard verified complete: checks ok, the summary is of
    this very shard, no file missing, and as many files as the shard owns."""
    if not isinstance(summary, dict) or summary.get("ok") is not True:
        return False
    stats = summary.get("stats")
    if not isinstance(stats, dict):
        return False
    if stats.get("world_size", 1) != world_size or stats.get("rank", 0) != rank:
        return False
    samples = stats.get("samples")
    if not isinstance(samples, int) or stats.get("missing"):
        return False
    return stats.get("files") == len(shard(samples, rank, world_size))


def plan_fanout(
    hosts: list[HostConfig],
    stage: str,
    *,
    run_id: str | None,
    extra: Iterable[str] | StageArgs = (),
    resume: bool = False,
    previous: dict | None = None,
    environ: Mapping[str, str] | None = None,
) -> FanoutPlan:
    """Host i gets `--world-size N --rank i`; an earlier record of the same run id must have been made
    with the same hosts, stage and arguments; its complete shards are skipped, the others resume.
    `environ`: the operator's environment, for the secrets each host's `secrets` list names."""
    args = extra if isinstance(extra, StageArgs) else parse(extra)
    extra = args.argv
    if stage not in SHARDED:
        raise ConfigError(
            f"stage {stage} cannot be split over hosts (only {', '.join(SHARDED)}); run it with one --host"
        )
    names = [h.name for h in hosts]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(
            f"hosts {', '.join(dupes)} appear twice in the host list; each host takes one shard"
        )
    own = [a for a in extra if a.split("=", 1)[0] in OWN_FLAGS]
    if own:
        raise ConfigError(f"{own[0]} is set per host by the multi-host run; drop it from the stage arguments")
    run_id = run_id or (previous or {}).get("run_id") or new_run_id(stage)
    n = len(hosts)
    done: dict[str, dict] = {}
    if previous is not None:
        _check_same_run(previous, run_id, stage, names, extra)
        done = {s["host"]: s for s in previous.get("hosts", []) if s.get("complete")}
    jobs = []
    for rank, host in enumerate(hosts):
        again = previous is not None or resume  # an earlier attempt may have left part of this shard
        names = available(host.secrets, environ or {})
        env_file_text(
            names, environ or {}
        )  # a value docker cannot take fails now, before any host is touched
        plan = plan_stage(
            host,
            stage,
            run_id=run_id,
            extra_args=args,
            shard=(n, rank),
            resume=again,
            layout=known(host.layout, args),
            secret_names=names,
        )
        skip = None
        if host.name in done:
            files = done[host.name].get("files")
            skip = f"shard {rank}/{n} verified complete in an earlier attempt ({files} files)"
        jobs.append(HostJob(host, rank, n, plan, skip))
    return FanoutPlan(run_id, stage, n, extra, tuple(jobs), previous)


def _check_same_run(
    previous: dict, run_id: str, stage: str, names: list[str], extra: tuple[str, ...]
) -> None:
    if previous.get("kind") != KIND:
        raise ConfigError(f"runs folder of {run_id} holds no multi-host run record; choose another --run-id")
    before = list(previous.get("host_order", []))
    if before != names:
        raise ConfigError(
            f"run {run_id} was made with hosts {','.join(before)} (in this order, one shard each); "
            "re-run it with that HOST list or choose another --run-id"
        )
    if previous.get("stage") != stage:
        raise ConfigError(
            f"run {run_id} was a {previous.get('stage')} run, not {stage}; choose another --run-id"
        )
    if list(previous.get("extra", [])) != list(extra):
        raise ConfigError(
            f"run {run_id} was made with stage arguments {previous.get('extra')!r}; re-run it with "
            "the same arguments or choose another --run-id"
        )


def find_previous(runs_dir: Path, run_id: str | None, stage: str, names: list[str]) -> dict | None:
    """The merged record of the run to continue: runs/<run-id>/summary.json, or with no run id the most
    recent multi-host record of the same stage and host list."""
    if run_id is not None:
        path = run_dir(runs_dir, run_id) / SUMMARY
        return _read(path) if path.is_file() else None
    found = [
        (r.get("updated", ""), r)
        for r in map(_read, runs_dir.glob(f"*/{SUMMARY}"))
        if r.get("kind") == KIND and r.get("stage") == stage and r.get("host_order") == names
    ]
    if not found:
        raise ConfigError(
            f"--resume: no earlier {stage} run of hosts {','.join(names)} in {runs_dir}; pass its --run-id"
        )
    return max(found, key=lambda x: x[0])[1]


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is unreadable ({exc}); move it away or choose another --run-id") from None
    return data if isinstance(data, dict) else {}


# ---------------------------------------------------------------- merging (pure)


def host_section(result: HostResult, world_size: int) -> dict:
    """One host's part of the merged record."""
    if result.status == SKIPPED and result.previous is not None:
        return {**result.previous, "status": SKIPPED, "error": "", "seconds": 0.0}
    summary = result.summary if isinstance(result.summary, dict) else None
    stats = (summary or {}).get("stats")
    stats = stats if isinstance(stats, dict) else {}
    complete = result.status == OK and shard_complete(summary, world_size, result.rank)
    return {
        "host": result.host,
        "rank": result.rank,
        "status": result.status,
        "exit_code": result.exit_code,
        "error": result.error,
        "seconds": round(result.seconds, 1),
        "complete": complete,
        "samples": stats.get("samples"),
        "files": stats.get("files", 0),
        "tokens": stats.get("tokens", 0),
        "missing": stats.get("missing") if summary else None,
        "summary": f"{result.host}/{SUMMARY}" if summary else None,
        "provenance": provenance_facts(summary),
        "schema_note": schema_note(summary) if summary else None,
    }


def merge(plan: FanoutPlan, results: list[HostResult]) -> dict:
    """The run's record: per-host sections and totals over all shards (files, tokens, which ranks are
    complete, which data files are missing)."""
    sections = [host_section(r, plan.world_size) for r in sorted(results, key=lambda r: r.rank)]
    sizes = sorted({s["samples"] for s in sections if isinstance(s.get("samples"), int)})
    samples = sizes[0] if len(sizes) == 1 else None
    missing: list[int] = []
    unknown: list[int] = []
    for s in sections:
        if s["complete"]:
            continue
        if isinstance(s.get("missing"), list) and s.get("samples") == samples and samples is not None:
            missing += s["missing"]
        elif samples is not None:
            missing += range(s["rank"], samples, plan.world_size)
        else:
            unknown.append(s["rank"])
    complete = [s["rank"] for s in sections if s["complete"]]
    files = sum(s.get("files") or 0 for s in sections)
    return {
        "kind": KIND,
        "run_id": plan.run_id,
        "stage": plan.stage,
        "world_size": plan.world_size,
        "host_order": list(plan.hosts),
        "extra": list(plan.extra),
        "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "attempts": int((plan.previous or {}).get("attempts", 0)) + 1,
        "hosts": sections,
        "totals": {
            "samples": samples,
            "files": files,
            "tokens": sum(s.get("tokens") or 0 for s in sections),
            "complete_ranks": complete,
            "incomplete_ranks": [s["rank"] for s in sections if not s["complete"]],
            "missing_files": sorted(missing),
            "unknown_ranks": unknown,
            "samples_disagree": sizes if len(sizes) > 1 else [],
            "provenance_disagree": disagreements([s["provenance"] for s in sections if s.get("provenance")]),
        },
        "complete": len(complete) == plan.world_size and samples is not None and files == samples,
    }


def exit_code(merged: dict, interrupted: bool = False) -> int:
    """0 when every shard is complete; 130 after Ctrl-C; else EXIT_HOSTS_FAILED (each row says why)."""
    if interrupted:
        return EXIT_INTERRUPTED
    return 0 if merged["complete"] else EXIT_HOSTS_FAILED


# ---------------------------------------------------------------- running


class PrefixedLines:
    """A file for one host's output: whole lines go to the shared sink as `HOST | line`, one lock for all
    hosts so lines never interleave mid-way."""

    def __init__(self, prefix: str, sink, lock: threading.Lock) -> None:
        self.prefix, self.sink, self.lock, self.buf = prefix, sink, lock, ""

    def write(self, text: str) -> int:
        self.buf += text
        if "\n" in self.buf:
            *lines, self.buf = self.buf.split("\n")
            with self.lock:
                self.sink.write("".join(f"{self.prefix}{ln.rstrip(chr(13))}\n" for ln in lines))
                self.sink.flush()
        return len(text)

    def flush(self) -> None:  # partial lines wait for their newline
        pass

    def close(self) -> None:
        if self.buf:
            self.write("\n")

    def isatty(self) -> bool:
        return False


def host_console(name: str, width: int, sink, lock: threading.Lock) -> Console:
    prefix = f"{name} | "
    return Console(
        file=PrefixedLines(prefix, sink, lock),
        highlight=False,
        soft_wrap=True,
        no_color=True,
        width=max(40, width - len(prefix)),
    )


def run_host(
    job: HostJob, request: RunRequest, *, connect: Callable, local_dir: Path, console: Console
) -> HostResult:
    """The ordinary one-host flow (preflight, gpu-clean, stage, summary, restore) on this host's own
    connection; every failure, expected or not, becomes the host's row."""
    start = time.monotonic()
    result = HostResult(job.host.name, job.rank, FAILED)
    (local_dir / SUMMARY).unlink(missing_ok=True)  # an earlier attempt's summary must not pass for this one's
    try:
        runner = connect(job.host, accept_new_host_key=request.accept_new_host_key)
        try:
            out = remote_run(runner, job.host, job.plan, request, console=console, local_dir=local_dir)
        finally:
            runner.close()
        result.exit_code, result.summary = out.exit_code, out.summary
        if out.exit_code == 0 and shard_complete(out.summary, job.world_size, job.rank):
            result.status = OK
        else:
            result.error = _stage_error(out.exit_code, out.summary, local_dir)
    except KeyboardInterrupt:
        result.exit_code, result.error = EXIT_INTERRUPTED, "interrupted"
    except OpsError as exc:
        result.exit_code, result.error = exc.exit_code, str(exc)
    except Exception as exc:  # a bug or an unforeseen failure on one host must not take the others down
        result.exit_code, result.error = 1, f"{type(exc).__name__}: {exc}"
    result.seconds = time.monotonic() - start
    console.print(f"{result.status}" + (f": {result.error}" if result.error else ""), markup=False)
    return result


def _stage_error(code: int | None, summary: dict | None, local_dir: Path) -> str:
    if summary is None:
        return f"stage exit code {code}: {_log_error(local_dir / 'stage.log')}"
    failed = [c for c in summary.get("checks", []) if c.get("status") == "fail"]
    if failed:
        c = failed[0]
        where = f"{c['file']}: " if c.get("file") else ""
        return f"stage exit code {code}; {where}{c.get('name')}: {c.get('detail')}"
    stats = summary.get("stats") or {}
    files, missing = stats.get("files"), stats.get("missing")
    return f"stage exit code {code}; shard incomplete ({files} files, missing {missing})"


def _log_error(log: Path) -> str:
    """The stage's own error line (the pipeline prints `error: ...` last), else where the log is."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    named = [ln for ln in lines if "rror" in ln]
    return (named or lines or ["no output"])[-1][:300] + f" (no summary.json; log: {log})"


def _wait(done: list[threading.Event]) -> None:
    """Until every host's flow has ended. Not Thread.join: on Python 3.11 a Ctrl-C that lands inside
    join() marks the joined thread as stopped while it still runs (CPython gh-90882)."""
    for ev in done:
        while not ev.wait(0.2):
            pass


def run_fanout(
    plan: FanoutPlan, request: RunRequest, *, connect: Callable, console: Console
) -> tuple[dict, bool]:
    """Every host at once, one thread and one connection each (the request's --restore-server, --wait and
    host-key choice for each); writes runs/<run-id>/summary.json after all hosts finished. Returns the
    merged record and whether the operator pressed Ctrl-C."""
    root = run_dir(request.runs_dir, plan.run_id)
    root.mkdir(parents=True, exist_ok=True)
    lock, record_lock = threading.Lock(), threading.Lock()
    results: dict[str, HostResult] = {}
    threads = []

    def record() -> dict:
        """The record as it stands; rewritten as each host finishes, so that a re-run after the operator's
        machine died mid-run still skips the hosts that had completed."""
        with record_lock:
            rows = [
                results.get(j.host.name) or HostResult(j.host.name, j.rank, RUNNING, error="did not report")
                for j in plan.jobs
            ]
            merged = merge(plan, rows)
            write_json(root / SUMMARY, merged)
            return merged

    console.print(f"run id [bold]{plan.run_id}[/] on {plan.world_size} hosts; local folder {root}")
    for job in plan.jobs:
        console.print(
            f"  rank {job.rank}/{plan.world_size} {job.host.name}: "
            + (f"skipped: {job.skip}" if job.skip else shlex.join(stage_arguments(job.plan.stage_argv))),
            markup=False,
        )
        if job.skip:
            prev = next(s for s in plan.previous["hosts"] if s["host"] == job.host.name)
            results[job.host.name] = HostResult(job.host.name, job.rank, SKIPPED, exit_code=0, previous=prev)
            continue
        hc = host_console(job.host.name, console.width, console.file, lock)
        done = threading.Event()

        def work(job=job, hc=hc, done=done) -> None:
            try:
                results[job.host.name] = run_host(
                    job, request, connect=connect, local_dir=root / job.host.name, console=hc
                )
                hc.file.close()
                record()
            finally:
                done.set()

        threads.append((threading.Thread(target=work, name=f"host-{job.host.name}", daemon=True), done))
    record()
    for t, _ in threads:
        t.start()
    presses = 0
    while True:  # each host's own remote_run handler stops its stage and restores its server on Ctrl-C
        try:
            _wait([done for _, done in threads])
            break
        except KeyboardInterrupt:
            presses += 1
            console.print(
                "interrupted: stopping the stage on every host"
                + (" now" if presses > 1 else " after each host's current step (Ctrl-C again: at once)")
            )
            for t, done in threads:
                if not done.is_set():
                    interrupt_thread(t, now=presses > 1)
    interrupted = presses > 0
    for job in plan.jobs:  # a thread hit by Ctrl-C before its flow began has no row of its own
        results.setdefault(
            job.host.name,
            HostResult(job.host.name, job.rank, FAILED, EXIT_INTERRUPTED, "interrupted before it started"),
        )
    return record(), interrupted
