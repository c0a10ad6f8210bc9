"""Output directories: refuse to clobber, stage whole-directory outputs, swap them in at the end.

Owns the policy every stage follows for its output location: an existing non-empty output is an error
unless the operator said ``--overwrite`` (or ``--resume`` where a stage supports it), and a stage that
produces a whole directory at once builds it under a staging name and renames it into place, so that
an interrupted run leaves the previous output (or nothing) rather than half of a new one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from pipeline.errors import StageError


def is_nonempty_dir(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def check_output_dir(path: Path, *, overwrite: bool, resume: bool = False, flag_hint: str = "--overwrite") -> None:
    if path.exists() and not path.is_dir():
        raise StageError(f"output {path} exists and is not a directory: choose another --out")
    if is_nonempty_dir(path) and not (overwrite or resume):
        raise StageError(f"output dir {path} is not empty: pass {flag_hint} to replace it, or choose another --out")


@contextlib.contextmanager
def staged_dir(target: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield an empty staging directory; on success it replaces ``target`` atomically (per rename)."""
    check_output_dir(target, overwrite=overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.staging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)
