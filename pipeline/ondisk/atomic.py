"""Atomic file writes: write to a temporary name next to the target, fsync, then rename.

Owns the temporary-name convention. Temporary names never end in ``pt``, so speculators'
``list_files`` (which loads every file ending in ``pt``) never picks up a partial file. Also owns how a
failed write is told: as an OSError naming the file it was for, and a full disk (ENOSPC, EDQUOT) as
``DiskFull``, whose reason reads "disk full: ...", whichever library wrote (safetensors and torch wrap the
OS's error in their own exception types; numpy and torch report a short write, "N requested and M written",
with no error code at all: the file system's free space, read before the partial file is removed, tells).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
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
        named = write_error(exc, target)  # before the partial file goes: its blocks tell a full disk
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if named is not None:
            raise named from exc
        raise


@contextlib.contextmanager
def writing(path: Path | str) -> Iterator[None]:
    """A write of ``path`` (a file or a folder) by code that does not use atomic_path (a library's own
    save into a staging folder): a failure is raised as write_error tells it, naming ``path``."""
    try:
        yield
    except BaseException as exc:
        named = write_error(exc, path)
        if named is not None:
            raise named from exc
        raise


class DiskFull(OSError):
    """A write that failed because the file system (or the user's quota) is full: ``filename`` is the file
    it was for, and the reason reads "disk full: No space left on device" (or "... Disk quota exceeded")."""

    def __init__(self, code: int, filename: str) -> None:
        super().__init__(code, f"disk full: {os.strerror(code)}", filename)


# how a full disk or quota reads in the text of an error a library made from the OS's (safetensors:
# "No space left on device (os error 28)")
_FULL = {errno.ENOSPC: ("No space left on device", "os error 28"), errno.EDQUOT: ("Disk quota exceeded",)}
# a short write, told with no error code: numpy's tofile/save ("4096 requested and 1024 written"), torch's
# zip writer ("PytorchStreamWriter failed writing file data/0: file write failed", "unexpected pos")
_SHORT = re.compile(r"\d+ requested and \d+ written|file write failed|unexpected pos \d+")
#: a file system with less free space than this, right after a short write to it, is full
NEARLY_FULL_BYTES = 1 << 20


def _free_bytes(path: Path | str) -> int | None:
    """Bytes this user may still write on the file system that holds ``path`` (its folder), or None."""
    try:
        st = os.statvfs(Path(path).parent)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def full_disk_errno(exc: BaseException, path: Path | str | None = None) -> int | None:
    """ENOSPC or EDQUOT when ``exc``, or an exception it was raised from, is a full disk or quota, as an
    OSError or in a library's own wrapper; with ``path`` (the file being written, its partial copy still
    there), also a short write to a file system that is left with under NEARLY_FULL_BYTES; else None."""
    seen: set[int] = set()
    short = False
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL:
            return exc.errno
        text = str(exc)
        for code, phrases in _FULL.items():
            if any(p in text for p in phrases):
                return code
        short = short or bool(_SHORT.search(text))
        exc = exc.__cause__ or exc.__context__
    if short and path is not None and (free := _free_bytes(path)) is not None and free < NEARLY_FULL_BYTES:
        return errno.ENOSPC
    return None


def write_error(exc: BaseException, path: Path | str) -> OSError | None:
    """The OSError to raise for ``exc``, a failed write of ``path``, when ``exc`` does not say enough by
    itself: a full disk, as DiskFull naming the file (the one ``exc`` names, else ``path``), whatever raised
    it; an OSError or a short write that names no file, naming ``path``; None to raise ``exc`` as it is (it
    already is a DiskFull or a stage's one line, it names its file, or it is not a file error)."""
    from pipeline.errors import StageError

    if not isinstance(exc, Exception) or isinstance(exc, (StageError, DiskFull)):
        return None  # Ctrl-C, or a refusal that says what to do (extract's "re-run with --resume")
    code = full_disk_errno(exc, path)
    if code is not None:
        return DiskFull(code, exc.filename if isinstance(exc, OSError) and exc.filename else str(path))
    if isinstance(exc, OSError) and not exc.filename and exc.errno is not None:
        return OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(path))
    if not (isinstance(exc, OSError) and exc.filename) and _SHORT.search(str(exc)):
        return OSError(errno.EIO, f"short write ({' '.join(str(exc).split())})", str(path))
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
