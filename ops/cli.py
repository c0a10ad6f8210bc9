"""`python -m ops`: the operator's commands.

Owns argument parsing, opening the one connection per command, calling the step modules, printing
through ops.report, and turning results and OpsError into exit codes (see ops.errors). No logic of its
own beyond that.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import click
from rich.console import Console

from contract.stages import STAGES
from ops import errors
from ops.connection import Runner, connect
from ops.hosts import HostConfig, check_seconds, resolve_host
from ops.request import RunRequest
from ops.secret_env import redact

console = Console(highlight=False, soft_wrap=True)
notes = Console(stderr=True, highlight=False, soft_wrap=True)  # progress notes that must not mix with --json


def _host_choice(fn):
    """--host, --hosts-file, --accept-new-host-key, passed on as host_spec, hosts_file,
    accept_new_host_key."""
    fn = click.option("--accept-new-host-key", is_flag=True, help="trust and record an unknown SSH host key")(
        fn
    )
    fn = click.option(
        "--hosts-file",
        type=click.Path(dir_okay=False),
        default=None,
        help="hosts TOML (default: $EAGLE_OPS_HOSTS, ./hosts.toml, ~/.config/eagle-ops/hosts.toml)",
    )(fn)
    return click.option(
        "--host",
        "host_spec",
        required=True,
        metavar="NAME|user@host[:port]|local",
        help="a name from the hosts file, user@host[:port], or `local` (this machine, no SSH)",
    )(fn)


@contextmanager
def _connected(host: HostConfig, accept_new_host_key: bool) -> Iterator[Runner]:
    """The command's one connection to the host, closed (and its trace written) when the command ends."""
    runner = connect(host, accept_new_host_key=accept_new_host_key)
    try:
        yield runner
    finally:
        runner.close()
        _write_trace(runner)


def host_options(fn):
    """A one-host command: the host resolved and connected, passed as host and runner."""

    @_host_choice
    @functools.wraps(fn)
    def wrapper(host_spec, hosts_file, accept_new_host_key, **kw):
        host = resolve_host(host_spec, hosts_file)
        with _connected(host, accept_new_host_key) as runner:
            return fn(host=host, runner=runner, **kw)

    return wrapper


def _fan_out(request: RunRequest) -> None:
    """Several hosts, one shard each (ops.fanout)."""
    from ops import fanout
    from ops.report import print_fanout, print_stage_plan

    hosts = [resolve_host(n, request.hosts_file) for n in request.hosts]
    previous = (
        fanout.find_previous(request.runs_dir, request.run_id, request.stage, [h.name for h in hosts])
        if (request.run_id or request.resume)
        else None
    )
    plan = fanout.plan_fanout(
        hosts,
        request.stage,
        run_id=request.run_id,
        extra=request.args,
        resume=request.resume,
        previous=previous,
        environ=os.environ,
    )
    if request.dry_run:
        for job in plan.jobs:
            console.print(
                f"rank {job.rank}/{plan.world_size} {job.host.name}"
                + (f": skipped: {job.skip}" if job.skip else "")
            )
            if not job.skip:
                print_stage_plan(console, job.host, job.plan)
        return
    merged, interrupted = fanout.run_fanout(plan, request, connect=connect, console=console)
    print_fanout(console, merged, request.runs_dir / plan.run_id)
    code = fanout.exit_code(merged, interrupted)
    if code:
        sys.exit(code)


def _write_trace(runner: Runner) -> None:
    """$EAGLE_OPS_TRACE=FILE: append every remote command with its seconds (benchmark breakdowns)."""
    path = os.environ.get("EAGLE_OPS_TRACE")
    log = getattr(runner, "log", None)
    if path and log is not None:
        with open(path, "a") as fh:
            for cmd, sec in zip(log.commands, log.seconds):
                fh.write(redact(json.dumps({"seconds": round(sec, 4), "command": cmd[:200]})) + "\n")


def wait_option(fn):
    return click.option(
        "--wait",
        "lock_wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        callback=lambda _ctx, _param, v: v and check_seconds(v, "--wait"),
        help="when another ops command holds the host, wait up to SECONDS instead of refusing",
    )(fn)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Drive a GPU host: gpu-status, gpu-clean, stop/restore the server, run pipeline stages remotely."""


@main.command("gpu-status")
@host_options
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def gpu_status(host: HostConfig, runner: Runner, as_json: bool) -> None:
    """Per GPU: memory, utilisation and every compute process, classified protected/server/orphan."""
    from ops.gpus import probe, unreadable
    from ops.report import dumps, print_status

    state = probe(runner, host)
    if as_json:
        click.echo(dumps(state))
    else:
        print_status(console, state)
    if state.gpu_error:  # a status without the GPUs is no status: what was read is shown, the exit says so
        raise unreadable(state)


@main.command("gpu-clean")
@host_options
@click.option("--dry-run", is_flag=True, help="print the plan; stop and signal nothing")
@click.option("--json", "as_json", is_flag=True, help="machine-readable report")
@wait_option
def gpu_clean(host: HostConfig, runner: Runner, dry_run: bool, as_json: bool, lock_wait: float) -> None:
    """Stop the server, SIGTERM/SIGKILL the other GPU holders (never protected ones), verify clean."""
    from contextlib import nullcontext

    from ops.clean import VERDICT_EXIT, gpu_clean as clean
    from ops.gpus import probe
    from ops.lock import host_lock, refuse_killing_stages
    from ops.report import dumps, print_clean

    with nullcontext() if dry_run else host_lock(runner, host, "gpu-clean", wait=lock_wait, console=notes):
        before = probe(runner, host)
        if not dry_run:
            refuse_killing_stages(runner, host, before)
        report = clean(runner, host, dry_run=dry_run, before=before)
    if as_json:
        click.echo(dumps(report))
    else:
        print_clean(console, report)
    if not dry_run and VERDICT_EXIT[report.verdict]:
        sys.exit(VERDICT_EXIT[report.verdict])


@main.command("stop-server")
@host_options
@wait_option
def stop_server(host: HostConfig, runner: Runner, lock_wait: float) -> None:
    """Stop the inference server by the host's strategy and check nothing of it is left."""
    from ops import server
    from ops.gpus import probe
    from ops.lock import host_lock

    with host_lock(runner, host, "stop-server", wait=lock_wait, console=notes):
        record = server.stop(runner, host, probe(runner, host).server)
        left = probe(runner, host).server
    if not record.was_running:
        console.print(f"server {record.strategy}: not running, nothing to stop")
    else:
        console.print(f"stopped server {record.strategy}: {', '.join(record.stopped)}")
    if left.running or record.survivors:
        pids = ", ".join(str(p) for p in left.members) or ", ".join(
            c[:12] for c in left.running_container_ids
        )
        raise errors.OpsError(
            f"server {record.strategy} still has processes after stop: {pids}",
            exit_code=errors.EXIT_SERVER_STOP,
        )


@main.command("restore-server")
@host_options
@wait_option
def restore_server(host: HostConfig, runner: Runner, lock_wait: float) -> None:
    """Bring the inference server back by the host's strategy (no-op when it already runs)."""
    from ops.restore import restore

    done = restore(runner, host, command="restore-server", wait=lock_wait, console=notes)
    console.print("\n".join(done) if done else f"server {host.server}: already running or strategy none")


def _stage_options(fn):
    @click.option("--run-id", default=None, help="name this run (default: STAGE-UTCSTAMP-XXXX)")
    @click.option("--resume", is_flag=True, help="continue into a non-empty output folder")
    @click.option(
        "--restore-server", is_flag=True, help="bring the server back at the end, also on failure/Ctrl-C"
    )
    @click.option(
        "--runs-dir",
        type=click.Path(file_okay=False),
        default="runs",
        show_default=True,
        help="local folder for runs/<host>/<run-id>/",
    )
    @click.option(
        "--dry-run", is_flag=True, help="print the stage plan (docker run argv, secret names); run nothing"
    )
    @click.option(
        "--detach", is_flag=True, help="start the stage and return, leaving it running; `attach RUN_ID` later"
    )
    @wait_option
    @functools.wraps(fn)
    def wrapper(**kw):
        return fn(**kw)

    return wrapper


def _run_stage(request: RunRequest) -> None:
    """One host: plan, then run it (or print it with --dry-run)."""
    from ops.layout import known
    from ops.remote_run import remote_run
    from ops.report import print_stage_plan
    from ops.secret_env import available, env_file_text
    from ops.stage import new_run_id, plan_stage

    host = resolve_host(request.host, request.hosts_file)
    names = available(host.secrets, os.environ)
    env_file_text(names, os.environ)  # a value docker cannot take fails now, before anything is stopped
    plan = plan_stage(
        host,
        request.stage,
        run_id=request.run_id or new_run_id(request.stage),
        extra_args=request.args,
        resume=request.resume,
        secret_names=names,
        layout=known(host.layout, request.args),
    )
    if request.dry_run:
        print_stage_plan(console, host, plan)
        return
    with _connected(host, request.accept_new_host_key) as runner:
        out = remote_run(runner, host, plan, request, console=console)
    if not out.detached:
        _finish(out)


def _finish(out) -> None:
    """Print the summary; exit with the stage's code, else EXIT_SERVER_RESTORE if the restore failed."""
    from ops.report import print_summary

    print_summary(console, out.summary, out.exit_code, out.local_dir)
    if out.exit_code:
        sys.exit(out.exit_code)
    if out.restore_error is not None:
        raise out.restore_error


@main.command("remote-run", context_settings={"ignore_unknown_options": True})
@click.argument("stage", type=click.Choice(list(STAGES)))
@_host_choice
@_stage_options
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def remote_run_cmd(**options) -> None:
    """Preflight, gpu-clean, run `pipeline STAGE` in the image on the host, fetch summary and logs.
    Arguments after `--` go to the stage command. Several hosts (`--host a,b`): one shard each."""
    request = RunRequest.from_options(**options)
    if request.multi_host:
        _fan_out(request)
    else:
        _run_stage(request)


@main.command("remote-extract", context_settings={"ignore_unknown_options": True})
@_host_choice
@_stage_options
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def remote_extract(**options) -> None:
    """remote-run extract: hidden states of the prepared samples, verified, summary fetched."""
    request = RunRequest.from_options(stage="extract", **options)
    if request.multi_host:
        _fan_out(request)
    else:
        _run_stage(request)


@main.command("remote-train", context_settings={"ignore_unknown_options": True})
@_host_choice
@_stage_options
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def remote_train(**options) -> None:
    """remote-run train: the draft trained on the host, with the states mode, budget and GPU split of the
    hosts file's train table (`--dry-run` shows them and why)."""
    _run_stage(RunRequest.from_options(stage="train", **options))


@main.command("remote-regenerate", context_settings={"ignore_unknown_options": True})
@_host_choice
@_stage_options
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def remote_regenerate(**options) -> None:
    """remote-run regenerate: the conversations' answers rewritten by the host's running server (the hosts
    file's server_endpoint and served_model), which is never stopped; no GPU, no gpu-clean."""
    _run_stage(RunRequest.from_options(stage="regenerate", **options))


@main.command("attach")
@click.argument("run_id")
@_host_choice
@click.option("--runs-dir", type=click.Path(file_okay=False), default="runs", show_default=True)
@click.option("--restore-server", is_flag=True, help="bring the server back once the stage has finished")
@wait_option
def attach_cmd(**options) -> None:
    """Follow a stage container again (after an SSH drop or --detach), then fetch its summary and logs."""
    from ops.remote_run import attach
    from ops.stage import check_run_id

    request = RunRequest.from_options(**options)
    check_run_id(request.run_id)
    host = resolve_host(request.host, request.hosts_file)
    with _connected(host, request.accept_new_host_key) as runner:
        out = attach(runner, host, request, console=console)
    _finish(out)


@main.command("ship-image")
@host_options
@click.option(
    "--image", default=None, help="local image to send (default: the host's `image` in the hosts file)"
)
@click.option("--dry-run", is_flag=True, help="compare image ids; send nothing")
def ship_image_cmd(host: HostConfig, runner: Runner, image: str | None, dry_run: bool) -> None:
    """docker save | ssh | docker load of the image onto the host; nothing is sent when it already has it."""
    import docker
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from ops.ship import ship

    try:
        client = docker.from_env()
    except docker.errors.DockerException as exc:
        raise errors.OpsError(f"local docker engine: {exc} (is dockerd running here?)") from None
    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=notes,
        transient=False,
    )
    started = []

    def progress(total: int | None):  # shown only once bytes flow: an error or a skip stays one line
        bar.start()
        started.append(True)
        task = bar.add_task(f"docker save | {host.name} docker load", total=total)
        return lambda n: bar.advance(task, n)

    try:
        ship(runner, client, image or host.image, dry_run=dry_run, progress=progress, say=console.print)
    finally:
        if started:
            bar.stop()


def run() -> None:
    try:
        main(standalone_mode=False)
    except errors.OpsError as exc:
        click.echo(redact(f"error: {exc}"), err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(errors.EXIT_INTERRUPTED)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(errors.EXIT_INTERRUPTED)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except (
        OSError
    ) as exc:  # a local file operation (a full laptop disk under runs/): one line, not a traceback
        where = f" {exc.filename}" if exc.filename else ""
        click.echo(redact(f"error: file operation failed{where}: {exc.strerror or exc}"), err=True)
        sys.exit(errors.EXIT_ERROR)
