"""Real containers for the ops tests, made with the docker SDK from the locally built base image."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import docker

from ops_procs import HOLDER, write_gpu_table

BASE_IMAGE = "eagle-ops-test-base:bookworm"
TEST_LABEL = "eagle-ops-test"
BUILD_BASE = Path(__file__).parent / "images" / "build_base.sh"


def client() -> docker.DockerClient:
    c = docker.from_env()
    c.ping()
    return c


def ensure_base_image() -> str:
    subprocess.run(["bash", str(BUILD_BASE), BASE_IMAGE], check=True, capture_output=True)
    return BASE_IMAGE


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def holder_container(
    c: docker.DockerClient,
    name: str,
    devdir: Path,
    files: list[Path],
    labels: dict | None = None,
    proc_name: str = "VLLM::EngineCore",
):
    """A detached container whose main process holds device files (bind-mounted at the same path)."""
    ctr = c.containers.run(
        BASE_IMAGE,
        ["python3", "-c", HOLDER, proc_name, "0", *map(str, files)],
        name=name,
        detach=True,
        labels={TEST_LABEL: "1", **(labels or {})},
        volumes={str(devdir): {"bind": str(devdir), "mode": "rw"}},
    )
    for line in ctr.logs(stream=True):
        if b"ready" in line:
            break
    ctr.reload()
    return ctr


def server_on_one_gpu(c: docker.DockerClient, folder: Path, prefix: str, used_mib: int = 9000):
    """A server container holding the host's one "GPU" (folder/dev/nvidia0) and the GPU table (gpu_source)
    that lists its main process there. Returns (container, device dir, table path)."""
    devdir = folder / "dev"
    devdir.mkdir()
    (devdir / "nvidia0").write_bytes(b"")
    server = holder_container(c, unique(prefix), devdir, [devdir / "nvidia0"])
    table = write_gpu_table(
        folder / "gpus.json", [{"processes": [{"pid": server.attrs["State"]["Pid"], "used_mib": used_mib}]}]
    )
    return server, devdir, table


def remove_test_containers(c: docker.DockerClient, names: list[str]) -> None:
    for name in names:
        try:
            c.containers.get(name).remove(force=True)
        except docker.errors.NotFound:
            pass


STAGE_IMAGE = "eagle-ops-test-stage"


def stage_image(
    c: docker.DockerClient, repo: Path, python_home: str, venv: str | None = None
) -> tuple[str, list[str]]:
    """A stage image for the tests: the base plus PATH to the test run's venv (default: the running
    one, sys.prefix) and PYTHONPATH to this checkout (so a worktree's own code runs, not the code the venv
    was installed from); the checkout, the venv and its interpreter are bind-mounted read-only at the
    same paths (returned as hosts-file mounts)."""
    import io
    import sys

    import hashlib

    ensure_base_image()
    venv = venv or sys.prefix
    # one tag per checkout: two checkouts testing on one engine must not run each other's PATH
    tag = f"{STAGE_IMAGE}:{hashlib.sha1(f'{repo}:{venv}'.encode()).hexdigest()[:12]}"
    dockerfile = (
        f"FROM {BASE_IMAGE}\nENV PATH={venv}/bin:/usr/local/bin:/usr/bin:/bin PYTHONPATH={repo} "
        "PYTHONDONTWRITEBYTECODE=1\n"
    )
    c.images.build(
        fileobj=io.BytesIO(dockerfile.encode()), tag=tag, pull=False, rm=True, labels={TEST_LABEL: "1"}
    )
    mounts = [f"{repo}:{repo}:ro", f"{python_home}:{python_home}:ro"]
    if not Path(venv).resolve().is_relative_to(Path(repo).resolve()):
        mounts.append(f"{venv}:{venv}:ro")
    return tag, mounts
