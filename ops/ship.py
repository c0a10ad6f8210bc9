"""ship-image: the operator's image onto a host without registry access, ``docker save | ssh | docker load``.

Owns the decision (nothing is sent when the host already has an image of that name with the same id), the
byte stream (the local engine's ``docker save`` through the docker SDK, fed into ``docker load`` on the
host over the command's one connection, ops.connection), and the check that the host's image id now
equals ours. The host, its image name, key and known_hosts come from the hosts file like every other ops
command. Does not build images (make image) and takes no host lock: loading an image disturbs nothing
that runs.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass

from ops.connection import Runner
from ops.errors import OpsError

CHUNK = 1 << 20


@dataclass(frozen=True)
class ShipPlan:
    image: str
    local_id: str
    remote_id: str | None  # None: the host has no image of that name

    @property
    def needed(self) -> bool:
        return self.remote_id != self.local_id

    def describe(self, host: str) -> str:
        if not self.needed:
            return f"{self.image}: {host} already has {self.local_id[:19]}, nothing to send"
        have = f"has {self.remote_id[:19]}" if self.remote_id else "has no such image"
        return f"{self.image}: {host} {have}; sending {self.local_id[:19]} with `{LOAD}`"


LOAD = "docker load"


def inspect_command(image: str) -> str:
    return shlex.join(["docker", "image", "inspect", "--format", "{{.Id}}", image])


def remote_image_id(runner: Runner, image: str) -> str | None:
    """The id of ``image`` on the host, or None when the host has no image of that name."""
    res = runner.run(inspect_command(image))
    if res.ok:
        return res.stdout.strip() or None
    if "no such image" in res.stderr.lower():
        return None
    last = (res.stderr.strip().splitlines() or [f"exit {res.exit_code}"])[-1]
    raise OpsError(
        f"`{inspect_command(image)}` failed on {runner.label}: {last} (is docker installed there, "
        "and may this user run it?)"
    )


def local_image(docker_client, image: str):
    import docker.errors

    try:
        return docker_client.images.get(image)
    except docker.errors.ImageNotFound:
        raise OpsError(f"no local image {image}: build it first (make image), or pass --image") from None
    except docker.errors.DockerException as exc:
        raise OpsError(f"local docker engine: {exc}") from None


def ship(
    runner: Runner,
    docker_client,
    image: str,
    *,
    dry_run: bool = False,
    progress: Callable[[int | None], Callable[[int], None]] | None = None,
    say=print,
) -> ShipPlan:
    """Ship ``image`` from the local engine to the host behind ``runner``; return the plan.
    ``progress(total)`` gives the per-chunk callback of a progress display."""
    local = local_image(docker_client, image)
    plan = ShipPlan(image, local.id, remote_image_id(runner, image))
    say(plan.describe(runner.label))
    if not plan.needed or dry_run:
        return plan
    on_bytes = progress(int(local.attrs.get("Size") or 0) or None) if progress else (lambda _n: None)
    res = runner.feed(LOAD, local.save(chunk_size=CHUNK, named=True), on_bytes)
    text = (res.stdout + res.stderr).strip()
    if not res.ok:
        last = text.splitlines()[-1] if text else "no output"
        raise OpsError(
            f"`{LOAD}` on {runner.label} exited {res.exit_code}: {last} (free disk there, then re-run)"
        )
    if text:
        say(text)
    now = remote_image_id(runner, image)
    if now != local.id:
        raise OpsError(
            f"after docker load the host's {image} is {now}, not {local.id}: re-run, or check the host's "
            "disk space (docker load output above)"
        )
    say(f"{image}: {runner.label} now has {local.id[:19]}")
    return plan
