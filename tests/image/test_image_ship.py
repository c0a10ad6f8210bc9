"""`make ship-image` against a real sshd on 127.0.0.1 whose `docker` is a second, empty Docker engine:
the image travels through docker save | ssh | docker load, a second run sends nothing, host keys are checked."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile

import pytest
import ship_image
from image_helpers import REPO, RUN_ID, sh
from ops_sshd import start_sshd

pytestmark = [pytest.mark.docker, pytest.mark.sshd, pytest.mark.slow]

SMALL = f"eagle-ops-ship-test:{RUN_ID}"


@pytest.fixture(scope="module")
def small_image(docker_client):
    """A tiny image (one file, docker import) in the local engine."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"payload for the ship test\n" * 4096
        info = tarfile.TarInfo("payload.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    subprocess.run(["docker", "import", "-", SMALL], input=buf.getvalue(), check=True, capture_output=True)
    yield docker_client.images.get(SMALL)
    docker_client.images.remove(SMALL, force=True)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


def ship_cli(sshd, engine, *extra: str, known_hosts=None) -> subprocess.CompletedProcess:
    known = known_hosts or sshd.write_known_hosts(sshd.root / "known_hosts")
    return sh(
        sys.executable,
        "docker/ship_image.py",
        f"{sshd.user}@127.0.0.1",
        SMALL,
        "--port",
        str(sshd.port),
        "--identity",
        str(sshd.user_key),
        "--known-hosts",
        str(known),
        "--remote-docker",
        f"docker -H {engine.socket}",
        *extra,
        timeout=300,
    )


def remote_id(engine) -> str | None:
    res = sh("docker", "-H", engine.socket, "image", "inspect", "--format", "{{.Id}}", SMALL, timeout=60)
    return res.stdout.strip() if res.returncode == 0 else None


def test_ship_sends_then_skips(small_image, second_engine, sshd):
    """The first ship loads the image on the host with the same id; the second finds it there and sends nothing."""
    assert remote_id(second_engine) is None
    dry = ship_cli(sshd, second_engine, "--dry-run")
    assert dry.returncode == 0, dry.stdout
    assert "has no such image" in dry.stdout and remote_id(second_engine) is None
    first = ship_cli(sshd, second_engine)
    assert first.returncode == 0, first.stdout
    assert "Loaded image" in first.stdout and "host now has" in first.stdout
    assert remote_id(second_engine) == small_image.id
    second = ship_cli(sshd, second_engine)
    assert second.returncode == 0, second.stdout
    assert "nothing to send" in second.stdout and "Loaded image" not in second.stdout


def test_ship_refuses_unknown_host_key(small_image, second_engine, sshd, tmp_path):
    """A host whose key is not in known_hosts is refused before anything is sent."""
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    res = ship_cli(sshd, second_engine, known_hosts=empty)
    assert res.returncode == 1
    assert "not found in known_hosts" in res.stdout


def test_ship_reports_a_failing_remote_docker(small_image, second_engine, sshd):
    """A docker command that cannot run on the host is a one-line error naming the command."""
    known = sshd.write_known_hosts(sshd.root / "known_hosts")
    res = sh(
        sys.executable,
        "docker/ship_image.py",
        f"{sshd.user}@127.0.0.1",
        SMALL,
        "--port",
        str(sshd.port),
        "--identity",
        str(sshd.user_key),
        "--known-hosts",
        str(known),
        "--remote-docker",
        "docker -H unix:///nonexistent.sock",
        timeout=300,
    )
    assert res.returncode == 1
    assert "error: `docker -H unix:///nonexistent.sock image inspect" in res.stdout


def test_ship_plan_quotes_remote_words():
    """Every word of the remote commands is shell-quoted (an image name cannot inject a command)."""
    plan = ship_image.ShipPlan("img;rm -rf /", "sha256:a", None, ("sudo", "docker"))
    assert (
        ship_image.remote_command(plan.inspect_argv)
        == "sudo docker image inspect --format '{{.Id}}' 'img;rm -rf /'"
    )
    assert ship_image.remote_command(plan.load_argv) == "sudo docker load"
    assert plan.needed and not ship_image.ShipPlan("i", "sha256:a", "sha256:a", ("docker",)).needed


def test_make_ship_image_needs_host():
    """`make ship-image` without HOST= stops with a usage line."""
    res = sh("make", "--no-print-directory", "ship-image", timeout=60, cwd=REPO)
    assert res.returncode != 0 and "usage: make ship-image HOST=" in res.stdout
