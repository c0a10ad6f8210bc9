#!/usr/bin/env python3
"""Ship a local image to a host without registry access: ``docker save | ssh HOST docker load``.

Owns the decision (skip when the host already has an image with the same id) and the byte stream
(the local engine's ``docker save`` through the docker SDK, into ``docker load`` on the host through
a paramiko channel on a Fabric connection, with a rich progress bar), then checks that the host's
image id equals ours. Does not build images, choose hosts or manage servers; the SSH connection is
passed in (the CLI below opens one with host keys checked against known_hosts, unknown keys refused).

    python docker/ship_image.py [user@]HOST[:PORT] [IMAGE] [--identity KEY] [--known-hosts FILE]
                                [--remote-docker "sudo docker"] [--dry-run]

Exit codes: 0 shipped or already there; 1 the transfer or the load failed; 2 bad input.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

CHUNK = 1 << 20


class ShipError(Exception):
    """A failure the operator must act on; the message says what and how."""


@dataclass(frozen=True)
class ShipPlan:
    image: str
    local_id: str
    remote_id: str | None  # None: the host has no image of that name
    remote_docker: tuple[str, ...]

    @property
    def needed(self) -> bool:
        return self.remote_id != self.local_id

    @property
    def inspect_argv(self) -> tuple[str, ...]:
        return (*self.remote_docker, "image", "inspect", "--format", "{{.Id}}", self.image)

    @property
    def load_argv(self) -> tuple[str, ...]:
        return (*self.remote_docker, "load")

    def describe(self) -> str:
        if not self.needed:
            return f"{self.image}: host already has {self.local_id[:19]}, nothing to send"
        have = f"has {self.remote_id[:19]}" if self.remote_id else "has no such image"
        return f"{self.image}: host {have}; sending {self.local_id[:19]} with `{shlex.join(self.load_argv)}`"


def remote_command(argv: Iterable[str]) -> str:
    """A remote shell command line from argv, every word quoted."""
    return shlex.join(list(argv))


def remote_image_id(conn, image: str, remote_docker: tuple[str, ...]) -> str | None:
    """The id of IMAGE on the host, or None when the host has no image of that name."""
    argv = (*remote_docker, "image", "inspect", "--format", "{{.Id}}", image)
    res = conn.run(remote_command(argv), hide=True, warn=True, in_stream=False)
    if res.exited == 0:
        return res.stdout.strip() or None
    if "No such image" in res.stderr or "no such image" in res.stderr.lower():
        return None
    raise ShipError(
        f"`{remote_command(argv)}` failed on the host ({res.exited}): {res.stderr.strip()}"
        " (is docker installed there, and may this user run it? see --remote-docker)"
    )


def plan_ship(conn, image: str, local_id: str, remote_docker: tuple[str, ...] = ("docker",)) -> ShipPlan:
    return ShipPlan(image, local_id, remote_image_id(conn, image, remote_docker), tuple(remote_docker))


def stream_load(conn, plan: ShipPlan, chunks: Iterable[bytes], on_bytes: Callable[[int], None]) -> str:
    """Send the image tar into ``docker load`` on the host; return what docker load printed."""
    transport = conn.client.get_transport()
    channel = transport.open_session()
    try:
        channel.exec_command(remote_command(plan.load_argv))
        for chunk in chunks:
            if channel.exit_status_ready():
                break  # docker load gave up early; its stderr says why
            channel.sendall(chunk)
            on_bytes(len(chunk))
        channel.shutdown_write()
        out, err = bytearray(), bytearray()
        while True:
            if channel.recv_ready():
                out += channel.recv(65536)
            elif channel.recv_stderr_ready():
                err += channel.recv_stderr(65536)
            elif channel.exit_status_ready() and not channel.recv_ready() and not channel.recv_stderr_ready():
                break
            else:
                channel.status_event.wait(0.1)
        status = channel.recv_exit_status()
    finally:
        channel.close()
    text = (out + err).decode(errors="replace").strip()
    if status != 0:
        raise ShipError(f"`{remote_command(plan.load_argv)}` on the host exited {status}: {text}")
    return text


def ship(
    conn,
    docker_client,
    image: str,
    *,
    remote_docker: tuple[str, ...] = ("docker",),
    dry_run: bool = False,
    console=None,
) -> ShipPlan:
    """Ship IMAGE from the local engine (docker SDK client) to the host behind conn; return the plan."""
    import docker.errors
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    console = console or Console(stderr=True, soft_wrap=True)  # messages are one line each, never wrapped
    try:
        local = docker_client.images.get(image)
    except docker.errors.ImageNotFound:
        raise ShipError(f"no local image {image}: build it first (make image)") from None
    plan = plan_ship(conn, image, local.id, remote_docker)
    console.print(plan.describe())
    if not plan.needed or dry_run:
        return plan
    total = int(local.attrs.get("Size") or 0)
    columns = (
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(f"docker save | ssh {conn.host} docker load", total=total or None)
        printed = stream_load(
            conn, plan, local.save(chunk_size=CHUNK, named=True), lambda n: progress.advance(task, n)
        )
    if printed:
        console.print(printed)
    now = remote_image_id(conn, image, remote_docker)
    if now != local.id:
        raise ShipError(
            f"after docker load the host's {image} is {now}, not {local.id}: re-run, or check the "
            "host's disk space (docker load output above)"
        )
    console.print(f"{image}: host now has {local.id[:19]}")
    return plan


def open_connection(target: str, *, identity: Path | None, known_hosts: Path | None, port: int | None):
    """A Fabric connection whose host key must already be known (paramiko's RejectPolicy)."""
    import fabric
    import paramiko

    kwargs = {}
    if identity:
        kwargs["connect_kwargs"] = {
            "key_filename": str(identity),
            "allow_agent": False,
            "look_for_keys": False,
        }
    conn = fabric.Connection(target, port=port, **kwargs)
    conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
    if known_hosts:
        if not known_hosts.is_file():
            raise ShipError(f"--known-hosts {known_hosts} does not exist")
        conn.client.load_host_keys(str(known_hosts))
    else:
        conn.client.load_system_host_keys()  # ~/.ssh/known_hosts, as ssh would
    return conn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("host", help="[user@]host[:port] as for ssh")
    parser.add_argument("image", nargs="?", default="eagle-ops:latest")
    parser.add_argument("--port", type=int)
    parser.add_argument("--identity", type=Path, help="private key file (default: ssh agent / ~/.ssh keys)")
    parser.add_argument("--known-hosts", type=Path, help="known_hosts file (default: ~/.ssh/known_hosts)")
    parser.add_argument(
        "--remote-docker", default="docker", help='docker command on the host, e.g. "sudo docker"'
    )
    parser.add_argument("--dry-run", action="store_true", help="compare image ids, send nothing")
    args = parser.parse_args(argv)
    remote_docker = tuple(shlex.split(args.remote_docker))
    if not remote_docker:
        print("error: --remote-docker is empty; give the docker command to run on the host", file=sys.stderr)
        return 2
    import paramiko

    import docker

    try:
        conn = open_connection(
            args.host, identity=args.identity, known_hosts=args.known_hosts, port=args.port
        )
    except ShipError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        ship(conn, docker.from_env(), args.image, remote_docker=remote_docker, dry_run=args.dry_run)
    except ShipError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except paramiko.SSHException as exc:
        print(
            f"error: ssh to {args.host}: {exc} (unknown host key? add it to known_hosts first: ssh {args.host})",
            file=sys.stderr,
        )
        return 1
    except docker.errors.DockerException as exc:
        print(f"error: local docker engine: {exc}", file=sys.stderr)
        return 1
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
