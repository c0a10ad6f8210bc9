"""Where the vLLM connector's per-request files wait until the backend has read them.

vLLM's ``ExampleHiddenStatesConnector`` hands each request's states over as a safetensors file (the engine
runs in another process). Those files live seconds: written by the engine, read once, deleted. On the output
file system they cost a second write of every byte the run keeps (the first GPU run: two writes per sample),
so they go to shared memory (``/dev/shm``, a tmpfs) when it has room for what can be in flight at once, and to
a scratch folder in ``--out`` otherwise (the choice and its reason are returned, for the run's log).

Owns: the choice, the folder's life, and the removal of folders left by killed runs. A live folder holds an
exclusive ``flock`` on its ``owner.lock`` for as long as its backend lives; a folder whose lock can be
taken is orphaned (its process is gone, also one in another container sharing ``/dev/shm``: locks do not
depend on PIDs) and is removed. A folder of a live run is never touched.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SHM = Path("/dev/shm")
PREFIX = ".vllm-states-"  # folders in --out (pipeline/extract/resume.py removes a killed run's on --resume)
SHM_PREFIX = "eagle-vllm-states-"  # folders in /dev/shm
LOCK = "owner.lock"
# the writer's back-pressure (pipeline/extract/writer.py: 2 GiB of states pending) plus this many batches
BATCHES_IN_FLIGHT = 3
PENDING_BYTES = 2 << 30
UNLOCKED_GRACE_S = 60.0


def in_flight_bytes(max_batch_tokens: int, layers: int, hidden_size: int, dtype_bytes: int) -> int:
    """The most bytes of connector files that can wait at once: the writer's pending bound plus a few batches
    (each at most ``max_batch_tokens`` tokens of ``layers`` states)."""
    return PENDING_BYTES + BATCHES_IN_FLIGHT * max_batch_tokens * layers * hidden_size * dtype_bytes


@dataclass(frozen=True)
class Choice:
    root: Path
    reason: str


def choose(out: Path, need: int, shm: Path = SHM) -> Choice:
    """Shared memory when it is a writable folder with twice ``need`` free, else ``out`` (pure but for a
    statvfs)."""
    try:
        st = os.statvfs(shm)
        free = st.f_bavail * st.f_frsize
    except OSError:
        return Choice(out, f"{shm} is not available")
    if not os.access(shm, os.W_OK):
        return Choice(out, f"{shm} is not writable")
    if free < 2 * need:
        return Choice(
            out, f"{shm} has {free / 2**30:.1f} GiB free, under twice the {need / 2**30:.1f} GiB in flight"
        )
    return Choice(shm, f"{shm} ({free / 2**30:.1f} GiB free; up to {need / 2**30:.1f} GiB in flight)")


class Scratch:
    """A fresh folder under ``root`` locked by this process; ``close`` removes it."""

    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        self.prefix = SHM_PREFIX if root == SHM else PREFIX
        remove_orphans(root, self.prefix)
        self.path = Path(tempfile.mkdtemp(prefix=self.prefix, dir=root))
        self._fd: int | None = os.open(self.path / LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def remove_orphans(root: Path, prefix: str) -> list[Path]:
    """Remove the folders under ``root`` named ``prefix*`` whose owner lock nobody holds; return them."""
    removed = []
    for folder in sorted(root.glob(prefix + "*")):
        if not folder.is_dir() or folder.is_symlink():
            continue
        try:
            fd = os.open(folder / LOCK, os.O_RDWR)
        except FileNotFoundError:
            # a folder from before the lock existed, or whose owner died before locking it; one made in the
            # last minute may be a live run's between its mkdtemp and its lock
            try:
                if time.time() - folder.stat().st_mtime < UNLOCKED_GRACE_S:
                    continue
            except OSError:
                continue
            fd = None
        except OSError:
            continue
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its run is alive
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        finally:
            if fd is not None:
                os.close(fd)
    return removed
