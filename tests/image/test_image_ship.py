"""`make ship-image` (`python -m ops ship-image`) against a real sshd on 127.0.0.1 whose `docker` is a
second, empty Docker engine: the image travels through docker save | ssh | docker load, a second run sends
nothing, host keys are checked, a docker that cannot run on the host is one line naming the command."""

from __future__ import annotations

import io
import subprocess
import tarfile

import pytest
from image_helpers import REPO, RUN_ID, sh
from ops_helpers import run_ops, ssh_table, write_hosts
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
def sshd(tmp_path_factory, second_engine):
    """The "remote" host: its sessions' docker is the second engine."""
    server = start_sshd(tmp_path_factory.mktemp("sshd"), env={"DOCKER_HOST": second_engine.socket})
    yield server
    server.stop()


def hosts(sshd, folder, known_hosts=None, **extra):
    known = known_hosts or sshd.write_known_hosts(folder / "known_hosts")
    return write_hosts(folder / "hosts.toml", "shipbox", image=SMALL, **ssh_table(sshd, known, **extra))


def ship(hosts_file, *extra: str) -> subprocess.CompletedProcess:
    return run_ops("ship-image", "--host", "shipbox", "--hosts-file", str(hosts_file), *extra, timeout=300)


def remote_id(engine) -> str | None:
    res = sh("docker", "-H", engine.socket, "image", "inspect", "--format", "{{.Id}}", SMALL, timeout=60)
    return res.stdout.strip() if res.returncode == 0 else None


def test_ship_sends_then_skips(small_image, second_engine, sshd, tmp_path):
    """The first ship loads the image on the host with the same id; the second finds it there and sends
    nothing."""
    f = hosts(sshd, tmp_path)
    assert remote_id(second_engine) is None
    dry = ship(f, "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "has no such image" in dry.stdout and remote_id(second_engine) is None
    first = ship(f)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "Loaded image" in first.stdout and "shipbox now has" in first.stdout
    assert remote_id(second_engine) == small_image.id
    second = ship(f)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "nothing to send" in second.stdout and "Loaded image" not in second.stdout


def test_ship_takes_another_image_by_flag(small_image, second_engine, sshd, tmp_path):
    """--image names a local image other than the hosts file's; one that does not exist is a one-line
    error."""
    f = hosts(sshd, tmp_path)
    res = ship(f, "--image", f"eagle-ops-ship-test:absent-{RUN_ID}")
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert f"no local image eagle-ops-ship-test:absent-{RUN_ID}: build it first" in res.stderr


def test_ship_refuses_unknown_host_key(small_image, sshd, tmp_path):
    """A host whose key is not in known_hosts is refused before anything is sent, with its SHA256
    fingerprint."""
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    res = ship(hosts(sshd, tmp_path, known_hosts=empty))
    assert res.returncode != 0
    assert "is unknown" in res.stderr and "SHA256:" in res.stderr and "--accept-new-host-key" in res.stderr


def test_ship_reports_a_failing_remote_docker(small_image, tmp_path):
    """A docker that cannot run on the host is a one-line error naming the command."""
    broken = start_sshd(tmp_path / "sshd", env={"DOCKER_HOST": "unix:///nonexistent.sock"})
    try:
        res = ship(hosts(broken, tmp_path))
    finally:
        broken.stop()
    assert res.returncode == 1, res.stdout + res.stderr
    assert "error: `docker image inspect --format '{{.Id}}' eagle-ops-ship-test:" in res.stderr
    assert res.stderr.count("\n") == 1


def test_image_names_are_quoted_on_the_host():
    """Every word of the remote inspect command is shell-quoted (an image name cannot inject a command)."""
    from ops.ship import ShipPlan, inspect_command

    assert inspect_command("img;rm -rf /") == "docker image inspect --format '{{.Id}}' 'img;rm -rf /'"
    assert ShipPlan("i", "sha256:a", None).needed and not ShipPlan("i", "sha256:a", "sha256:a").needed


def test_make_ship_image_needs_host():
    """`make ship-image` without HOST= stops with a usage line."""
    res = sh("make", "--no-print-directory", "ship-image", timeout=60, cwd=REPO)
    assert res.returncode != 0 and "usage: make ship-image HOST=" in res.stdout
