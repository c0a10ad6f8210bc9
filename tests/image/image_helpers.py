"""Helpers of the image tests: run commands from the repository root and build the CI image exactly as
`make image-ci` does (its build arguments are read from mk/image.mk)."""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(
    0, str(REPO / "docker")
)  # the image tests import docker/'s scripts (cudaarch, imageinfo, ...)


# Names derived from this checkout's path: test runs of two checkouts (a developer's and a CI clone) share
# one Docker engine and must not build, tag or remove each other's images and compose projects.
RUN_ID = hashlib.sha1(str(REPO).encode()).hexdigest()[:8]
CI_IMAGE = f"eagle-ops:ci-{RUN_ID}"
CI_BASE = "eagle-ops-image-ci-base:bookworm-4"
CI_LOCK = "requirements/image-ci.lock"


def sh(
    *argv: str, timeout: float = 1800, env: dict | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """Run a command from the repository root; stdout and stderr together in .stdout."""
    return subprocess.run(
        list(argv),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        check=False,  # callers assert on the return code
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def ci_build_args() -> list[str]:
    """The build arguments of `make image-ci`, read from mk/image.mk so that the test builds what CI
    builds."""
    out = sh("make", "--no-print-directory", "-s", "-n", "image-ci", timeout=60).stdout
    line = next(ln for ln in out.splitlines() if "docker/build.sh" in ln)
    words = shlex.split(line)
    return words[words.index("docker/build.sh") + 2 :]


def build_ci_image(*extra: str, tag: str = CI_IMAGE) -> subprocess.CompletedProcess:
    return sh("docker/build.sh", tag, *ci_build_args(), *extra, env={"LOCK": CI_LOCK})
