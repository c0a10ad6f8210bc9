#!/usr/bin/env python3
"""``make image-check``: does a built image hold what this checkout's lock file and patch set say?

Owns the comparison from the build host's side: the image's labels against the hashes of the local
lock and patch tree (docker/imageinfo.py), then the image's own self-check run inside a throwaway
container against the local lock and patches mounted read-only (exact versions of every pin, every
patch applied and current). Prints one line per check; exit 0 only when nothing failed.

Does not build, pull or change the image; the docker SDK client is passed in.

    python docker/image_check.py [IMAGE] [--lock FILE] [--patches DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import imageinfo
from selfcheck import CheckResult, check_hash, fail, ok

APP = "/opt/eagle-ops"


def label_checks(labels: dict[str, str], lock: Path, patches: Path) -> list[CheckResult]:
    """The image's identity labels against the local files (pure: labels are a dict)."""
    results = [
        check_hash("label lock", labels.get("eagle-ops.lock.sha256"), imageinfo.file_sha256(lock)),
        check_hash(
            "label patches", labels.get("eagle-ops.patches.sha256"), imageinfo.patches_sha256(patches)
        ),
    ]
    for res in results:
        if res.status == "warn":  # an image without the label was not built by docker/build.sh
            results[results.index(res)] = fail(res.name, "label missing: rebuild with `make image`")
    revision = labels.get("org.opencontainers.image.revision", "")
    results.append(
        ok("label revision", revision)
        if revision and revision != "unknown"
        else fail("label revision", "no git revision label: rebuild with `make image`")
    )
    return results


def selfcheck_in_image(client, image: str, lock: Path, patches: Path) -> tuple[int, str]:
    """Run the image's self-check against the local lock and patch tree; (exit code, output)."""
    container = client.containers.run(
        image,
        ["python", f"{APP}/docker/selfcheck.py", "--lock", "/check/lock.txt", "--patches", "/check/patches"],
        volumes={
            str(lock.resolve()): {"bind": "/check/lock.txt", "mode": "ro"},
            str(patches.resolve()): {"bind": "/check/patches", "mode": "ro"},
        },
        entrypoint=[],
        detach=True,
        network_mode="none",
        environment={"PYTHONDONTWRITEBYTECODE": "1"},
    )
    try:
        code = container.wait()["StatusCode"]
        output = container.logs().decode(errors="replace")
    finally:
        container.remove(force=True)
    return code, output


def check_image(client, image: str, lock: Path | None, patches: Path) -> tuple[list[CheckResult], str]:
    import docker.errors

    try:
        img = client.images.get(image)
    except docker.errors.ImageNotFound:
        return [fail("image", f"no local image {image}: build it (make image) or load it")], ""
    labels = img.labels or {}
    lock = lock or Path(labels.get("eagle-ops.lock.file") or "requirements/image.lock")
    for path, what in ((lock, "lock file"), (patches, "patch tree")):
        if not path.exists():
            return [fail("input", f"{what} {path} not found (run from the repository root)")], ""
    results = [ok("image", f"{image} {img.id[:19]} (lock {lock})")]
    results += label_checks(labels, lock, patches)
    code, output = selfcheck_in_image(client, image, lock, patches)
    results.append(
        ok("in-image selfcheck", "passed")
        if code == 0
        else fail("in-image selfcheck", f"exit {code}: see its lines above")
    )
    return results, output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("image", nargs="?", default="eagle-ops:latest")
    parser.add_argument("--lock", type=Path, help="lock file (default: the one named by the image's label)")
    parser.add_argument("--patches", type=Path, default=Path("patches"))
    args = parser.parse_args(argv)
    import docker

    try:
        results, output = check_image(docker.from_env(), args.image, args.lock, args.patches)
    except docker.errors.DockerException as exc:
        print(f"error: local docker engine: {exc}", file=sys.stderr)
        return 2
    if output:
        print(output.rstrip())
    for res in results:
        print(f"[image-check] {res.status:<4} {res.name:<18} {res.detail}")
    failed = [r for r in results if r.status == "fail"]
    print(f"[image-check] {'FAILED' if failed else 'passed'}: {len(results)} checks, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
