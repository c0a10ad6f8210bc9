"""remote-run / remote-extract / attach: the whole sequence on one connection.

Owns the order of steps (preflight, gpu-clean, start the stage container, follow it, fetch summary and
logs into runs/<host>/<run-id>/, restore the server when asked, also after a failure or Ctrl-C) and
the local run folder. Each step is a function taking the runner; a later host-side lock, state file or
multi-host fan-out wraps these steps rather than rewriting them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from ops import report, secret_env, server
from ops.clean import CLEAN, VERDICT_EXIT, CleanReport, gpu_clean
from ops.errors import EXIT_PREFLIGHT, OpsError, RemoteCommandError
from ops.gpus import GpuState, probe, probe_with_paths
from ops.hosts import HostConfig
from ops.connection import Runner
from ops.preflight import (CheckResult, docker_checks, failed, gpu_check, path_checks, paths_request, secrets_check,
                           user_check)
from ops.secret_env import RedactingWriter, redact
from ops.stage import StagePlan, find_argv, finish_argvs, logs_argv, resolve_user


@dataclass
class RunOutcome:
    run_id: str
    local_dir: Path
    exit_code: int | None = None
    summary: dict | None = None
    checks: list[CheckResult] = field(default_factory=list)
    clean: CleanReport | None = None
    restored: list[str] = field(default_factory=list)


def local_run_dir(runs_root: Path, host: HostConfig, run_id: str) -> Path:
    d = runs_root / host.name / run_id
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(redact(json.dumps(data, indent=2, sort_keys=True, default=str)))
    os.replace(tmp, path)


def preflight(runner: Runner, host: HostConfig,
              plan: StagePlan) -> tuple[list[CheckResult], str | None, GpuState, StagePlan]:
    """The checks, the image digest, the GPU probe, and the plan with its user resolved (stage_user auto:
    the data root's owner)."""
    checks, digest = docker_checks(runner, host, plan.run_id)
    state, facts = probe_with_paths(runner, host, paths_request(host, plan))
    checks.append(gpu_check(state))
    checks += path_checks(host, plan, facts)
    root = facts["paths"][host.data_root]
    if root.get("exists"):
        plan = resolve_user(plan, root["uid"], root["gid"])
    checks += [user_check(host, plan, facts), secrets_check(host, plan)]
    return checks, digest, state, plan


def start(runner: Runner, plan: StagePlan, environ: Mapping[str, str] = os.environ) -> str:
    """`docker run`; with secrets, through the env file that exists only while docker reads it."""
    if plan.env_dir is None:
        cmd, stdin = shlex.join(plan.docker_run), None
    else:
        cmd = secret_env.start_command(plan.docker_run, plan.env_dir)
        stdin = secret_env.env_file_text(plan.secret_names, environ)
    res = runner.run(cmd, stdin=stdin)
    if not res.ok:
        raise RemoteCommandError("starting the stage container", cmd, res.exit_code, res.stdout, res.stderr)
    return res.stdout.strip()


def follow(runner: Runner, host: HostConfig, container: str, host_output: str, local_dir: Path,
           console: Console) -> tuple[int, dict | None]:
    """Stream the container's logs (live and into stage.log), take its exit code, fetch summary.json,
    remove the finished container. A lost connection (or Ctrl-C in attach) leaves it running."""
    with (local_dir / "stage.log").open("w") as log:
        out = RedactingWriter(console.file, log)
        try:
            runner.run(shlex.join(logs_argv(container)), stream=out)
        finally:
            out.close()
    # exit code, run times and removal in one round trip (the stage's files live on the host's disk)
    cmd = " && ".join(shlex.join(argv) for argv in finish_argvs(container))
    res = runner.run(cmd)
    words = res.stdout.split()
    if not res.ok or len(words) < 3:
        raise RemoteCommandError("collecting the stage container", cmd, res.exit_code, res.stdout, res.stderr)
    code = int(words[0])
    write_json(local_dir / "container.json", {"container": container, "exit_code": code,
                                              "started_at": words[1], "finished_at": words[2]})
    summary = None
    try:
        runner.get(f"{host_output}/summary.json", local_dir / "summary.json")
        # redacted before anything reads it, should a stage have written a secret into it
        summary = json.loads(redact((local_dir / "summary.json").read_text()))
        write_json(local_dir / "summary.json", summary)
    except (OSError, ValueError):
        pass
    return code, summary


def remote_run(runner: Runner, host: HostConfig, plan: StagePlan, *, runs_root: Path, restore_server: bool,
               console: Console, local_dir: Path | None = None) -> RunOutcome:
    """local_dir: where the run's files land (default runs_root/<host>/<run-id>; a multi-host run passes
    runs/<run-id>/<host>)."""
    if local_dir is not None:
        local_dir.mkdir(parents=True, exist_ok=True)
    out = RunOutcome(plan.run_id, local_dir or local_run_dir(runs_root, host, plan.run_id))
    console.print(f"run id [bold]{plan.run_id}[/] on {host.name}; local folder {out.local_dir}")
    out.checks, digest, state, plan = preflight(runner, host, plan)
    report.print_checks(console, out.checks)
    record = {"run_id": plan.run_id, "host": host.name, "stage": plan.stage, "image": host.image,
              "image_digest": digest, "docker_run": list(plan.docker_run), "host_output": plan.host_output,
              "secrets": list(plan.secret_names),
              "checks": [c.__dict__ for c in out.checks]}
    write_json(out.local_dir / "run.json", record)
    bad = failed(out.checks)
    if bad:
        raise OpsError(f"preflight failed: {bad[0].name}: {bad[0].detail}", exit_code=EXIT_PREFLIGHT)
    try:
        out.clean = gpu_clean(runner, host, before=state)
        report.print_clean(console, out.clean)
        if out.clean.verdict != CLEAN:
            why = f"{out.clean.verdict}: {out.clean.detail}" if out.clean.detail else out.clean.verdict
            raise OpsError(f"GPUs not free ({why}); no stage started",
                           exit_code=VERDICT_EXIT[out.clean.verdict])
        started = False
        try:
            start(runner, plan)
            started = True
            console.print(f"started {plan.container}: {shlex.join(plan.stage_argv)}")
            out.exit_code, out.summary = follow(runner, host, plan.container, plan.host_output, out.local_dir, console)
        except KeyboardInterrupt:
            # the operator aborts the run: stop the stage gracefully (an SSH drop, by contrast, leaves it)
            if started:
                console.print(f"interrupted: stopping container {plan.container}")
                runner.run(shlex.join(["docker", "stop", "--time", str(int(host.timeouts.stop)), plan.container]))
            raise
    finally:
        if restore_server:
            out.restored = _restore(runner, host, out.clean, console)
    record.update(exit_code=out.exit_code, restored=out.restored)
    write_json(out.local_dir / "run.json", record)
    return out


def _restore(runner: Runner, host: HostConfig, clean: CleanReport | None, console: Console) -> list[str]:
    """Bring back what gpu-clean stopped (from its pre-stop facts); if it was interrupted mid-way, ask
    the host what is there."""
    try:
        if clean is None:
            done = server.restore(runner, host, probe(runner, host).server)
        elif clean.stopped is not None and clean.stopped.was_running:
            facts = dataclasses.replace(clean.before.server, running_container_ids=(), members=())
            done = server.restore(runner, host, facts)
        else:
            done = []
    except (OpsError, KeyboardInterrupt) as exc:
        console.print(f"[red]restoring the server failed:[/] {exc}")
        return []
    for line in done:
        console.print(f"restored: {line}")
    return done


def attach(runner: Runner, host: HostConfig, run_id: str, *, runs_root: Path, console: Console) -> RunOutcome:
    res = runner.run(shlex.join(find_argv(run_id)))
    rows = [line.split("\t") for line in res.stdout.splitlines() if line.strip()]
    if not res.ok or not rows:
        raise OpsError(f"no stage container for run id {run_id} on {host.name}; a finished run's files are in "
                       f"{runs_root / host.name / run_id}")
    name, state, _stage, output = rows[0]
    out = RunOutcome(run_id, local_run_dir(runs_root, host, run_id))
    console.print(f"attached to {name} ({state})")
    out.exit_code, out.summary = follow(runner, host, name, output, out.local_dir, console)
    return out

