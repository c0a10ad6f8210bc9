"""Output directories: refuse to clobber or overlap an input, one writer at a time, staged swaps.

Owns the policy every stage follows for its output location: an existing non-empty output is an error
unless the operator said ``--overwrite`` (or ``--resume`` where a stage supports it); an output that is,
contains or lies inside one of the stage's inputs is refused before anything is deleted; while a stage
writes an output it holds an exclusive lock on it (``.NAME.lock`` next to it, naming the holder), so a
second writer is refused; and a stage that produces a whole directory at once builds it under a staging
name and renames it into place, so that an interrupted run leaves the previous output (or nothing)
rather than half of a new one, and a failed final rename leaves no staging directory behind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from pipeline.errors import StageError
from pipeline.ondisk.atomic import DiskFull, write_error
from pipeline.ondisk.paths import resolved


def is_nonempty_dir(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def overlap(out: Path, inputs: dict[str, Path]) -> str | None:
    """How ``out`` collides with an input (it is, contains or lies inside it), or None. Symlinks resolved."""
    targets = _spellings(out)
    for flag, path in inputs.items():
        if path is None:
            continue
        for target in targets:
            for source in _spellings(path):
                if target == source:
                    return f"--out {out} is the input {flag} {path}"
                if target in source.parents:
                    return f"--out {out} contains the input {flag} {path}"
                if source in target.parents:
                    return f"--out {out} lies inside the input {flag} {path}"
    return None


def _spellings(path: Path) -> set[Path]:
    """A path as given (absolute, ``..`` folded) and with every symlink resolved: deleting either harms it."""
    return {Path(os.path.abspath(path)), resolved(path)}


def refuse_overlap(out: Path, inputs: dict[str, Path]) -> None:
    """Raise before anything is written or deleted when the output overlaps an input."""
    problem = overlap(out, inputs)
    if problem:
        raise StageError(
            f"{problem}: writing there would destroy an input; choose an --out outside the inputs"
        )


def check_output_dir(
    path: Path,
    *,
    overwrite: bool,
    resume: bool = False,
    flag_hint: str = "--overwrite",
    inputs: dict[str, Path] | None = None,
) -> None:
    refuse_overlap(path, inputs or {})
    if path.exists() and not path.is_dir():
        raise StageError(f"output {path} exists and is not a directory: choose another --out")
    if is_nonempty_dir(path) and not (overwrite or resume):
        raise StageError(
            f"output dir {path} is not empty: pass {flag_hint} to replace it, or choose another --out"
        )


def lock_path(target: Path, part: str = "") -> Path:
    return target.with_name(f".{target.name}{'.' + part if part else ''}.lock")


@contextlib.contextmanager
def output_lock(target: Path | str, part: str = "") -> Iterator[None]:
    """Hold the exclusive lock of output ``target`` (flock of ``.NAME.lock`` beside it, freed by the kernel
    when the holder dies); a second writer is refused in one line naming the holder. ``part`` names a
    share of the output that writers own separately (one host's shard). The lock file is removed as the
    holder lets go, so that nothing stays beside the output (a full disk included)."""
    target = Path(target)
    path = lock_path(target, part)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _locked(path, target)
    try:
        command = " ".join(Path(a).name if i == 0 else a for i, a in enumerate(sys.argv[:4]))
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        os.ftruncate(fd, 0)
        with contextlib.suppress(OSError):  # who holds it is for the refused writer's message; a full disk
            # refuses these bytes, never the lock (then the message says "another process")
            os.pwrite(
                fd, f"pid {os.getpid()} on {socket.gethostname()} ({command}, since {since})".encode(), 0
            )
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            # removed while still held: a writer that opened it meanwhile finds, once it holds its flock,
            # that the path no longer names its file (`_locked`), and locks the path anew
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    finally:
        os.close(fd)


def _locked(path: Path, target: Path) -> int:
    """An fd of the lock file ``path`` holding its exclusive flock, the file still at ``path`` once held
    (the previous holder removes it as it lets go); a held lock is refused in one line naming the holder."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise StageError(
                f"output {target} is being written by {holder}: wait for it to finish, "
                "or choose another --out"
            ) from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _swap_in(staging: Path, target: Path) -> None:
    """Rename ``staging`` over ``target``; on failure put the old output back, remove the staging dir and
    raise one line naming the cause."""
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    moved = False
    try:
        if target.exists():
            os.replace(target, old)
            moved = True
        os.replace(staging, target)
    except OSError as exc:
        if moved:
            with contextlib.suppress(OSError):
                os.replace(old, target)
        shutil.rmtree(staging, ignore_errors=True)
        raise StageError(
            f"cannot move the finished output into place at {target}: {exc.strerror or exc} "
            f"(the previous output, if any, is unchanged; make {target} a plain directory this user "
            "can replace, or choose another --out)"
        ) from None
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(target: Path, *, overwrite: bool, inputs: dict[str, Path] | None = None) -> Iterator[Path]:
    """Yield an empty staging directory; on success it replaces ``target`` atomically (per rename).
    The output's lock is held throughout; an output overlapping an input is refused first."""
    refuse_overlap(target, inputs or {})
    with output_lock(target):
        check_output_dir(target, overwrite=overwrite)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".{target.name}.staging-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            yield staging
        except BaseException as exc:
            # a full disk as such, naming the output, whoever wrote; told before the staging dir goes (its
            # blocks are what a short write's free-space check reads)
            named = write_error(exc, target)
            shutil.rmtree(staging, ignore_errors=True)
            told = named if named is not None else exc
            if isinstance(told, OSError) and isinstance(told.filename, str) and told.errno is not None:
                inner = Path(told.filename)  # a file of the removed staging dir: named as it would have been
                if staging in inner.parents:
                    name = str(target / inner.relative_to(staging))
                    full = isinstance(told, DiskFull)
                    named = DiskFull(told.errno, name) if full else OSError(told.errno, told.strerror, name)
            if named is not None:
                raise named from exc
            raise
        _swap_in(staging, target)
