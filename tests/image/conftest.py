"""Fixtures of the image tests: the real Docker engine, the CI image built from the real Dockerfile, a
second Docker engine and a real sshd standing in for a GPU host without registry access."""

from __future__ import annotations

import os
import sys

import pytest
from image_helpers import CI_BASE, CI_IMAGE, CI_LOCK, REPO, build_ci_image, sh

sys.path.insert(0, str(REPO / "tests" / "ops"))
from ops_dockerd import start_engine  # noqa: E402


@pytest.fixture(scope="session")
def docker_client():
    import docker

    try:
        # removing the CI images and pruning ~20 GB of build cache (below) took over the SDK's default 60 s
        # on a loaded 2-core machine
        client = docker.from_env(timeout=600)
        client.ping()
    except docker.errors.DockerException as exc:
        pytest.fail(f"no Docker engine ({exc}): start dockerd (.ci/setup.d/10-docker.sh)")
    return client


@pytest.fixture(scope="session")
def ci_image(docker_client):
    """The CI image built by the real Dockerfile (base, wheelhouse and build exactly as `make image-ci`).

    Under CI (CI set) the images this session built and the engine's build cache are removed at the end:
    together ~20 GB that the vLLM environment built after these tests needs. A developer's engine keeps
    them, so that a re-run reuses the cached layers."""
    base = sh("docker/build-ci-base.sh", CI_BASE)
    assert base.returncode == 0, base.stdout
    wheels = sh(
        "docker/wheelhouse.sh", CI_LOCK, "wheelhouse", "3.11", "36", env={"PIP": f"{sys.executable} -m pip"}
    )
    assert wheels.returncode == 0, wheels.stdout
    build = build_ci_image()
    assert build.returncode == 0, build.stdout[-6000:]
    yield build
    if os.environ.get("CI"):
        _free_ci_disk(docker_client)


def _free_ci_disk(client) -> None:
    """Remove every tag of this checkout's CI image and prune the build cache (CI's engine is its own)."""
    repo, _, tag = CI_IMAGE.partition(":")
    for image in client.images.list(name=repo):
        for name in image.tags:
            if name.partition(":")[2].startswith(tag):
                client.images.remove(name, force=True)
    client.api.prune_builds(all=True)


@pytest.fixture(scope="module")
def second_engine():
    """A second, private dockerd (tests/ops/ops_dockerd.py): the engine of the "remote" host in the ship
    tests."""
    engine = start_engine()
    yield engine
    engine.stop()
