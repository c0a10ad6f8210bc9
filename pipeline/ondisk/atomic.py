"""Atomic file writes: write to a temporary name next to the target, fsync, then rename.

Owns the temporary-name convention. Temporary names never end in ``pt``, so speculators'
``list_files`` (which loads every file ending in ``pt``) never picks up a partial file.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

PARTIAL_SUFFIX = ".partial"


def partial_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.{os.getpid()}{PARTIAL_SUFFIX}")


@contextlib.contextmanager
def atomic_path(target: Path | str, *, fsync: bool = True) -> Iterator[Path]:
    """Yield a temporary path; on success rename it over ``target``, on error remove it."""
    target = Path(target)
    tmp = partial_name(target)
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def write_json(target: Path | str, obj: object) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def remove_partials(directory: Path) -> list[Path]:
    """Delete leftovers of interrupted writes in ``directory``; return what was removed."""
    removed = []
    for p in directory.glob(f".*{PARTIAL_SUFFIX}"):
        p.unlink(missing_ok=True)
        removed.append(p)
    return removed
