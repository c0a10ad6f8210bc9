"""The background writer: each sample's ``data_{i}.pt`` written by a pool of threads while the next batch
runs, atomically (a temp name, then a rename), with its checksum record and the value facts its writer saw
(pipeline/ondisk/integrity.py judges them); back-pressure by bytes in flight."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.ondisk import integrity
from pipeline.ondisk import formats
from pipeline.errors import StageError

# torch only in annotations here: the functions that use it import it, so that a command that only parses its
# arguments (--help, check-args) never loads it (tests/pipeline/test_cli_imports.py)
if TYPE_CHECKING:
    import torch


# Writer threads per process: on the H200 host (16 cores, tmpfs), 4 left the loop waiting on them (123-144k
# tok/s, 0.1-1.2 s of writer wait per 0.8M tokens) where 8 and 16 kept up (154-164k, no wait; device busy 90%
# of the loop): docs/benchmarks-history.md, 2026-12-03. Each thread mostly waits in write(2) and sha256, which
# release the GIL, so more threads than cores cost little.
WRITER_THREADS = 8


@dataclass
class Sample:
    """One sample for the Writer: its index, token ids, per-layer states [T, H] and loss mask; its batch's
    ``ready`` (returns once the batch's device-to-host copies are done); and, where the backend made them
    on the device, each state's ``layer_profile.token_scales`` (None: the writer computes the facts)."""

    index: int
    ids: torch.Tensor
    states: list[torch.Tensor]
    mask: torch.Tensor
    ready: Callable[[], None] = lambda: None
    scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None


class Writer:
    """Writes samples on background threads while the device computes the next batches.

    Several threads: torch.save spends its time in write(2) and memcpy, which release the GIL. The
    back-pressure is in bytes, not samples: ``put`` waits while more than ``max_pending_bytes`` of states
    wait to be written (a batch is always accepted when nothing is pending, so a batch larger than the
    bound still passes). Each sample first waits, on its writer thread, for its batch's device-to-host
    copies (``ready``); the main thread never does.
    """

    def __init__(self, out: Path, threads: int = WRITER_THREADS, max_pending_bytes: int = 2 << 30):
        self.out = out
        self.queue: queue.Queue = queue.Queue()  # unbounded: the byte count below is the bound
        self.error: BaseException | None = None
        self.bytes = 0
        self.written = 0  # samples whose file is complete on disk: what the progress bar counts
        self.max_pending_bytes = max_pending_bytes
        self.wait_seconds = 0.0  # main-thread time spent waiting for room: the run was write-bound then
        # thread-seconds summed over the writer threads: in each sample's ``ready``, and writing it
        self.ready_seconds = self.write_seconds = 0.0
        self.cpu_seconds = 0.0  # the threads' CPU time, summed
        self._pending = 0
        self._room = threading.Condition()
        self.journal = formats.ChecksumJournal(out)  # each file's sha256, recorded once the file is complete
        self.threads = [
            threading.Thread(target=self._loop, name=f"extract-writer-{n}", daemon=True)
            for n in range(threads)
        ]
        for t in self.threads:
            t.start()

    def _loop(self) -> None:
        try:
            self._write_each()
        finally:
            with self._room:
                self.cpu_seconds += time.thread_time()

    def _write_each(self) -> None:
        while (item := self.queue.get()) is not None:
            nbytes = _nbytes(item.states)
            try:
                if self.error is None:
                    # the batch's device-to-host copies (hf), the sample's own file read (vllm), or nothing
                    t0 = time.perf_counter()
                    item.ready()
                    t1 = time.perf_counter()
                    target = formats.data_file(self.out, item.index)
                    # what the closing check judges, from the tensors in hand
                    facts = integrity.written_facts(item.ids, item.states, item.mask, item.scales)
                    digest = formats.write_sample(target, item.ids, item.states, item.mask)
                    self.journal.record(
                        target.name, replace(digest, mtime_ns=target.stat().st_mtime_ns, facts=facts)
                    )
                    size = digest.bytes
                    with self._room:
                        self.bytes += size
                        self.written += 1
                        self.ready_seconds += t1 - t0
                        self.write_seconds += time.perf_counter() - t1
            except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
                self.error = exc
            finally:
                del item  # return the host buffers to the allocator before making room
                with self._room:
                    self._pending -= nbytes
                    self._room.notify_all()

    def put(self, items: list[Sample]) -> None:
        nbytes = sum(_nbytes(item.states) for item in items)
        if items:
            t0 = time.perf_counter()
            with self._room:
                while (
                    self._pending and self._pending + nbytes > self.max_pending_bytes and self.error is None
                ):
                    self._room.wait()
                self._pending += nbytes
            self.wait_seconds += time.perf_counter() - t0
        self._raise()
        for item in items:
            self.queue.put(item)

    def close(self) -> None:
        for _ in self.threads:
            self.queue.put(None)
        for t in self.threads:
            t.join()
        self.journal.close()
        self._raise()

    def abort(self) -> None:
        """Stop the threads after an error on the main thread; queued samples are dropped, none
        half-written."""
        with self._room:
            self.error = self.error or RuntimeError("aborted")
            self._room.notify_all()
        try:
            while True:
                self.queue.get_nowait()
        except queue.Empty:
            pass
        for _ in self.threads:
            self.queue.put(None)
        for t in self.threads:
            t.join()
        self.journal.close()

    def _raise(self) -> None:
        if self.error is not None:
            err = self.error
            if isinstance(err, OSError):
                raise StageError(
                    f"writing {err.filename or self.out} failed: {err.strerror or err} "
                    "(free space, then re-run with --resume)"
                ) from err
            raise err


def _nbytes(states: list[torch.Tensor]) -> int:
    return sum(h.nbytes for h in states)
