"""remote-run / remote-extract / attach: the whole sequence on one connection.

Owns the order of steps (host lock and stage-container check, preflight, stop the server and free the GPUs
unless the stage asks the running server or needs no GPU (contract.stages: SERVER_UP, SERVER_KEPT; then
neither, nor a restore), start
the stage container, follow it, fetch summary and logs into runs/<host>/<run-id>/, restore the
server when asked), what each step leaves behind when it fails or the operator presses Ctrl-C (the
stage container is stopped and removed unless the operator detached; the server is brought back when
asked and when this run stopped it), and the local run folder with run.json and state.json
(ops.runstate). Each step is a function taking the runner.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from contract.stages import STAGES
from ops import localfile, report, restore, secret_env
from ops.clean import CLEAN, VERDICT_EXIT, CleanReport, gpu_clean
from ops.errors import EXIT_PREFLIGHT, OpsError, RemoteCommandError
from ops.gpus import GpuState, probe_with_paths, refuse_lasting
from ops.hosts import HostConfig
from ops.connection import Runner
from ops.interrupts import Interrupts
from ops.lock import host_lock, refuse_duplicate_run
from ops.request import RunRequest
from ops.preflight import (
    CheckResult,
    docker_checks,
    failed,
    model_dequantized_extra,
    model_experts,
    path_checks,
    paths_request,
    secrets_check,
    server_checks,
    split_check,
    user_check,
)
from ops.runstate import RunState, run_dir, write_json
from ops.secret_env import RedactingWriter, redact
from ops.stagecheck import stage_preflight
from ops.inventory import stage_containers
from ops.stage import StagePlan, abort_argvs, finish_argvs, logs_argv, resolve_user, with_image_digest


@dataclass
class RunOutcome:
    run_id: str
    local_dir: Path
    exit_code: int | None = None
    summary: dict | None = None
    checks: list[CheckResult] = field(default_factory=list)
    clean: CleanReport | None = None
    restored: list[str] = field(default_factory=list)
    restore_error: OpsError | None = None  # the stage's result stands; the CLI exits EXIT_SERVER_RESTORE
    detached: bool = False


def local_run_dir(runs_root: Path, host: HostConfig, run_id: str) -> Path:
    d = run_dir(runs_root, host.name, run_id)
    d.mkdir(parents=True, exist_ok=True)
    return d


def preflight(
    runner: Runner, host: HostConfig, plan: StagePlan
) -> tuple[list[CheckResult], str | None, GpuState, StagePlan]:
    """The checks, the image digest, the GPU probe, and the plan with its user resolved (stage_user auto:
    the data root's owner)."""
    checks, image = docker_checks(runner, host, plan.run_id)
    state, facts = probe_with_paths(runner, host, paths_request(host, plan))
    checks += server_checks(host, plan, state, image.min_driver)
    checks += [c for c in (split_check(plan, state),) if c is not None]
    checks += path_checks(host, plan, facts)
    weights = (facts.get("weights") or {}).get(host.model_dir)
    if weights is not None:
        plan = dataclasses.replace(plan, model_weights_bytes=weights)
    plan = dataclasses.replace(
        plan,
        model_experts=model_experts(host, facts),
        model_dequantized_extra=model_dequantized_extra(host, facts),
    )
    root = facts["paths"][host.data_root]
    if root.get("exists"):
        plan = resolve_user(host, plan, root["uid"], root["gid"])
    checks += [user_check(host, plan, facts), secrets_check(host, plan)]
    return checks, image.digest, state, plan


def start(runner: Runner, plan: StagePlan, environ: Mapping[str, str] = os.environ) -> str:
    """`docker run`; with secrets, through the env file that exists only while docker reads it."""
    if plan.env_dir is None:
        cmd, stdin = shlex.join(plan.docker_run), None
    else:
        cmd = secret_env.start_command(plan.docker_run, plan.env_dir)
        stdin = secret_env.env_file_text(plan.secret_names, environ)
    res = runner.run(cmd, stdin=stdin)
    if not res.ok:
        # a container docker created but could not start is removed: nothing is left behind
        runner.run(shlex.join(["docker", "rm", "--force", plan.container]))
        raise RemoteCommandError("starting the stage container", cmd, res.exit_code, res.stdout, res.stderr)
    return res.stdout.strip()


def follow(runner: Runner, container: str, local_dir: Path, console: Console) -> None:
    """Stream the container's logs, live and into stage.log, until it exits. A lost connection (or
    Ctrl-C in attach) leaves it running."""
    path = local_dir / "stage.log"
    try:
        with path.open("w") as log:
            out = RedactingWriter(console.file, log)
            try:
                runner.run(shlex.join(logs_argv(container)), stream=out)
            finally:
                out.close()
    except OSError as exc:  # the log's own file: a full local disk is told as such, naming it
        if exc.errno in localfile.FULL:
            raise localfile.write_error(exc, path) from None
        raise


def fetch(runner: Runner, container: str, host_output: str, local_dir: Path) -> tuple[int, dict | None]:
    """Take the finished container's exit code and run times, remove it, fetch summary.json."""
    # exit code, run times and removal in one round trip (the stage's files live on the host's disk)
    cmd = " && ".join(shlex.join(argv) for argv in finish_argvs(container))
    res = runner.run(cmd)
    words = res.stdout.split()
    if not res.ok or len(words) < 3:
        raise RemoteCommandError("collecting the stage container", cmd, res.exit_code, res.stdout, res.stderr)
    code = int(words[0])
    write_json(
        local_dir / "container.json",
        {"container": container, "exit_code": code, "started_at": words[1], "finished_at": words[2]},
    )
    # no summary on the host (a stage that failed early) is None; a full local disk is an error saying so
    if not localfile.fetch(runner, f"{host_output}/summary.json", local_dir / "summary.json"):
        return code, None
    return code, summary_of(local_dir / "summary.json")


def summary_of(path: Path) -> dict | None:
    """A fetched summary.json as a JSON object, rewritten redacted before anything reads it (should a stage
    have written a secret into it); None when it is unreadable or not an object (a damaged or foreign
    file: no summary, so the shard counts as not verified)."""
    try:
        data = json.loads(redact(path.read_text()))
    except (OSError, ValueError):
        return None
    write_json(path, data)
    return data if isinstance(data, dict) else None


def abort(runner: Runner, host: HostConfig, container: str, local_dir: Path) -> bool:
    """Ctrl-C: stop the stage gracefully, keep its whole log in stage.log, remove the container. True if
    it is gone."""
    stop, logs, rm = (shlex.join(a) for a in abort_argvs(container, host.timeouts.stop))
    res = runner.run(f"{stop} >/dev/null && {logs}", timeout=host.timeouts.stop + host.timeouts.command)
    if res.ok:
        (local_dir / "stage.log").write_text(redact(res.stdout + res.stderr))
    return runner.run(rm).ok


class _Run:
    """One remote run's steps and what they left behind (for the cleanup after Ctrl-C or a failure)."""

    def __init__(
        self,
        runner: Runner,
        host: HostConfig,
        plan: StagePlan,
        out: RunOutcome,
        state: RunState,
        interrupts: Interrupts,
        console: Console,
    ) -> None:
        self.runner, self.host, self.plan, self.out, self.state = runner, host, plan, out, state
        self.interrupts, self.console = interrupts, console
        self.before: GpuState | None = None  # the preflight's facts, from before any stop
        self.stop_began = False
        self.container: str | None = None  # started and not yet collected
        self.restore_done = False
        self.record: dict = {}  # run.json, once preflight has run

    def steps(self, held: ExitStack, *, wait: float, detach: bool, restore_server: bool) -> None:
        r, h, p, out, step = self.runner, self.host, self.plan, self.out, self.state.step
        step("connect")  # the connection is open: the state file starts here
        step("lock")
        with self.interrupts.interruptible():
            lock = held.enter_context(
                host_lock(r, h, f"remote-run {p.stage}", run_id=p.run_id, wait=wait, console=self.console)
            )
        refuse_duplicate_run(r, h, p.host_output)
        step("preflight")
        out.checks, digest, self.before, p = preflight(r, h, p)
        report.print_checks(self.console, out.checks)
        if not failed(out.checks):  # the stage's own preflight, in the image: the server still runs
            self.console.print(
                f"preflight in the image {h.image} (the server keeps running) ...", markup=False
            )
            p, inside = stage_preflight(r, h, p, self.before, out.local_dir)
            report.print_checks(self.console, inside, title="preflight in the image")
            out.checks += inside
        p = with_image_digest(h, p, digest)
        self.plan = p
        self.record = {
            "run_id": p.run_id,
            "host": h.name,
            "stage": p.stage,
            "image": h.image,
            "image_digest": digest,
            "docker_run": list(p.docker_run),
            "host_output": p.host_output,
            "server": STAGES[p.stage].server,
            "layout": dataclasses.asdict(p.layout) if p.layout else None,
            "train": dataclasses.asdict(p.train.states) if p.train else None,
            "preflight_run": list(p.preflight_run),
            "secrets": list(p.secret_names),
            "checks": [c.__dict__ for c in out.checks],
        }
        write_json(out.local_dir / "run.json", self.record)
        bad = failed(out.checks)
        if bad:
            if p.stops_server:  # a stage that needs no GPU is not refused for its facts
                refuse_lasting(self.before, "; nothing was stopped or started")  # the GPUs' exit code, 6
            raise OpsError(f"preflight failed: {bad[0].name}: {bad[0].detail}", exit_code=EXIT_PREFLIGHT)
        lock.ensure()
        if not p.stops_server:  # the stage asks the server or needs no GPU: the GPUs stay the server's
            why = "asks it" if p.server_up else "needs no GPU"
            self.console.print(f"server {h.server} kept running: {p.stage} {why}; no gpu-clean", markup=False)
        else:
            self.free_gpus(step)
        lock.ensure()
        step("start")
        self.container = p.container
        start(r, p)
        self.state.note(container=p.container)
        self.console.print(f"started {p.container}: {shlex.join(p.stage_argv)}")
        if detach:
            out.detached = True
            self.console.print(
                f"detached: {p.container} runs on; `attach {p.run_id}` follows it and fetches its summary"
            )
            return
        step("follow")
        with self.interrupts.interruptible():
            follow(r, p.container, out.local_dir, self.console)
        step("fetch")
        out.exit_code, out.summary = fetch(r, p.container, p.host_output, out.local_dir)
        self.container = None
        if restore_server and p.stops_server:
            step("restore")
            self.restore()
            self.interrupts.checkpoint()

    def free_gpus(self, step) -> None:
        """Stop the server and free the GPUs, proven clean (ops.clean); a host that is not clean is no run."""
        out = self.out
        step("stop-server")
        self.stop_began = True
        out.clean = gpu_clean(self.runner, self.host, before=self.before, on_step=step)
        self.state.note(server_stopped=bool(out.clean.stopped and out.clean.stopped.was_running))
        report.print_clean(self.console, out.clean)
        if out.clean.verdict != CLEAN:
            why = f"{out.clean.verdict}: {out.clean.detail}" if out.clean.detail else out.clean.verdict
            raise OpsError(
                f"GPUs not free ({why}); no stage started", exit_code=VERDICT_EXIT[out.clean.verdict]
            )

    def restore(self) -> None:
        """Bring back what this run stopped (from the facts seen before the stop); nothing when the stop
        never began, and not while a stage container runs (this run's own, left running when following it
        failed, or one started outside ops meanwhile). A failure or refusal is kept in out.restore_error and
        printed, never raised."""
        if self.restore_done:
            return
        self.restore_done = True
        if not self.stop_began or self.before is None:
            return
        try:
            self.out.restored = restore.restore(self.runner, self.host, stopped=self.before.server)
        except OpsError as exc:
            self.out.restore_error = exc
            self.console.print(f"[red]restoring the server failed:[/] {exc}")
        for line in self.out.restored:
            self.console.print(f"restored: {line}")
        self.state.note(
            server_restored=self.out.restored, restore_error=str(self.out.restore_error or "") or None
        )

    def abandon(self) -> None:
        """After Ctrl-C: the started, uncollected stage container is stopped and removed."""
        name, self.container = self.container, None
        if name is None or self.out.detached:
            return
        self.console.print(f"interrupted: stopping container {name}")
        self.state.note(container_removed=abort(self.runner, self.host, name, self.out.local_dir))


def _one_line(exc: BaseException) -> str:
    return redact(str(exc) if isinstance(exc, OpsError) else f"{type(exc).__name__}: {exc}")


def remote_run(
    runner: Runner,
    host: HostConfig,
    plan: StagePlan,
    request: RunRequest,
    *,
    console: Console,
    local_dir: Path | None = None,
) -> RunOutcome:
    """The request's --restore-server, --detach and --wait shape the run; local_dir: where the run's files
    land (default request.runs_dir/<host>/<run-id>; a multi-host run passes runs/<run-id>/<host>)."""
    restore_server, detach = request.restore_server, request.detach
    if local_dir is not None:
        local_dir.mkdir(parents=True, exist_ok=True)
    out = RunOutcome(plan.run_id, local_dir or local_run_dir(request.runs_dir, host, plan.run_id))
    console.print(f"run id [bold]{plan.run_id}[/] on {host.name}; local folder {out.local_dir}")
    with Interrupts(console) as interrupts, ExitStack() as held:
        state = RunState(
            out.local_dir / "state.json",
            interrupts,
            run_id=plan.run_id,
            host=host.name,
            stage=plan.stage,
            restore_server=restore_server,
            detach=detach,
        )
        run = _Run(runner, host, plan, out, state, interrupts, console)
        try:
            run.steps(held, wait=request.lock_wait, detach=detach, restore_server=restore_server)
        except KeyboardInterrupt:
            state.end("interrupted", "interrupted by Ctrl-C (SIGINT)")
            run.abandon()
            if restore_server:
                run.restore()
            raise
        except BaseException as exc:
            state.end("failed", _one_line(exc))
            if restore_server:
                run.restore()
            raise
        if out.restore_error is not None:
            state.end("failed", str(out.restore_error), exit_code=out.exit_code)
        else:
            state.end("detached" if detach else "done", exit_code=out.exit_code)
        run.record.update(exit_code=out.exit_code, restored=out.restored)
        write_json(out.local_dir / "run.json", run.record)
    return out


def attach(runner: Runner, host: HostConfig, request: RunRequest, *, console: Console) -> RunOutcome:
    """The request's run id, its runs folder, and --restore-server (under the host lock, --wait)."""
    run_id, runs_root = request.run_id, request.runs_dir
    found = stage_containers(runner, run_id)
    if not found:
        raise OpsError(
            f"no stage container for run id {run_id} on {host.name}; a finished run's files are in "
            f"{runs_root / host.name / run_id}"
        )
    name, cstate, stage, output = found[0].name, found[0].state, found[0].stage, found[0].output
    out = RunOutcome(run_id, local_run_dir(runs_root, host, run_id))
    state = RunState.reopen(out.local_dir / "state.json", None, run_id=run_id, host=host.name, stage=stage)
    try:
        state.step("attach")
        console.print(f"attached to {name} ({cstate})")
        state.step("follow")
        follow(runner, name, out.local_dir, console)
        state.step("fetch")
        out.exit_code, out.summary = fetch(runner, name, output, out.local_dir)
        if request.restore_server:
            state.step("restore")
            try:
                out.restored = restore.restore(
                    runner,
                    host,
                    command="attach --restore-server",
                    run_id=run_id,
                    wait=request.lock_wait,
                    console=console,
                )
            except OpsError as exc:
                out.restore_error = exc
            for line in out.restored:
                console.print(f"restored: {line}")
    except KeyboardInterrupt:
        state.end("interrupted", "interrupted by Ctrl-C (SIGINT); the stage runs on, attach again")
        raise
    except BaseException as exc:
        state.end("failed", _one_line(exc))
        raise
    state.end(
        "failed" if out.restore_error else "done",
        str(out.restore_error or "") or None,
        exit_code=out.exit_code,
        container_removed=True,
    )
    return out
