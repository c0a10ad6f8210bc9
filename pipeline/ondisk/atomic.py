"""Atomic file writes: write to a temporary name next to the target, fsync, then rename.

Owns the temporary-name convention. Temporary names never end in ``pt``, so speculators'
``list_files`` (which loads every file ending in ``pt``) never picks up a partial file. Also owns how a
failed write is told: as an OSError naming the file it was for, and a full disk (ENOSPC, EDQUOT) as that,
whichever library wrote (safetensors and torch wrap the OS's error in their own exception types).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
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
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        named = write_error(exc, target)
        if named is not None:
            raise named from exc
        raise


# how a full disk or quota reads in the text of an error a library made from the OS's (safetensors:
# "No space left on device (os error 28)")
_FULL = {errno.ENOSPC: ("No space left on device", "os error 28"), errno.EDQUOT: ("Disk quota exceeded",)}


def full_disk_errno(exc: BaseException) -> int | None:
    """ENOSPC or EDQUOT when ``exc``, or an exception it was raised from, is a full disk or quota, as an
    OSError or in a library's own wrapper; else None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL:
            return exc.errno
        text = str(exc)
        for code, phrases in _FULL.items():
            if any(p in text for p in phrases):
                return code
        exc = exc.__cause__ or exc.__context__
    return None


def write_error(exc: BaseException, path: Path | str) -> OSError | None:
    """The OSError to raise for ``exc``, a failed write of ``path``, when ``exc`` does not say enough by
    itself: a full disk in a library's wrapper, or an OSError that names no file; None to raise ``exc``
    as it is (it names its file, it already is a stage's one line, or it is not a file error)."""
    from pipeline.errors import StageError

    if not isinstance(exc, Exception) or isinstance(exc, StageError):
        return None  # Ctrl-C, or a refusal that says what to do (extract's "re-run with --resume")
    code = full_disk_errno(exc)
    if code is not None and not (isinstance(exc, OSError) and exc.filename):
        return OSError(code, os.strerror(code), str(path))
    if isinstance(exc, OSError) and not exc.filename and exc.errno is not None:
        return OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(path))
    return None


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


def replace_dir(staged: Path, target: Path, aside: Path) -> None:
    """Put the folder ``staged`` at ``target`` with renames only: an existing ``target`` is renamed to
    ``aside`` first, ``staged`` renamed in, then ``aside`` deleted. A kill at any instant leaves the old
    folder or the new one whole (at ``target``, or the old one at ``aside`` until its owner settles it)."""
    shutil.rmtree(aside, ignore_errors=True)
    if target.exists():
        os.replace(target, aside)
    os.replace(staged, target)
    shutil.rmtree(aside, ignore_errors=True)
