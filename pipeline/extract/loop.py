"""The extraction loop shared by every backend: batches to the backend, its states checked against their
inputs and handed to the writer, the progress bar; and the loop's clock (device idle, the first batch after
the process started, the file rate)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from pipeline.ondisk import formats
from pipeline.backends import Backend
from pipeline.errors import StageError
from pipeline.extract.plan import Batch
from pipeline.extract.writer import Sample, WRITER_THREADS, Writer


def progress_bar(enabled: bool):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]extract"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("samples"),
        TextColumn("{task.fields[tps]:>9,.0f} tok/s"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        disable=not enabled,
        transient=False,
    )


def run_loop(
    backend: Backend,
    prepared: formats.PreparedSamples,
    batches: list[Batch],
    out: Path,
    hidden_size: int,
    num_layers: int,
    total: int,
    done: set[int],
    progress: bool,
    writer_threads: int = WRITER_THREADS,
) -> dict:
    """Capture every pending batch (whole, so results never depend on what was done before) and write the
    samples not already on disk; return throughput figures."""
    writer = Writer(out, threads=writer_threads)
    t0, cpu0 = time.perf_counter(), time.thread_time()
    try:
        stats = _loop(backend, prepared, batches, writer, hidden_size, num_layers, total, done, progress, t0)
        # the main thread's CPU seconds in the loop: near its wall time, it computed or spun (in a launch or a
        # synchronize); far below, it waited (for the GIL, a blocking call)
        return stats | {"main_thread_cpu_seconds": time.thread_time() - cpu0}
    except BaseException:
        writer.abort()
        raise


def _loop(backend, prepared, batches, writer, hidden_size, num_layers, total, done, progress, t0) -> dict:
    tokens, capture_s = 0, 0.0
    with progress_bar(progress) as bar:
        task = bar.add_task("extract", total=total, completed=len(done), tps=0.0)
        # the previous batch's samples: handed to the writer once the next batch is queued
        in_flight: list = []
        for batch in batches:
            seqs = [prepared.ids(i) for i in batch.indices]
            c0 = time.perf_counter()
            captured = backend.capture_async([s.tolist() for s in seqs])
            capture_s += time.perf_counter() - c0
            items = _checked_items(backend, prepared, batch, seqs, captured, hidden_size, num_layers, done)
            # the device now has this batch queued: waiting for the writer's room costs it nothing
            writer.put(in_flight)
            in_flight = items
            tokens += sum(len(s) for s in seqs)
            elapsed = time.perf_counter() - t0
            # samples on disk, not queued: an interrupted run has exactly what the bar said (tok/s is
            # computed)
            bar.update(task, completed=len(done) + writer.written, tps=tokens / elapsed if elapsed else 0.0)
        writer.put(in_flight)
        writer.close()
        bar.update(task, completed=len(done) + writer.written)
    elapsed = time.perf_counter() - t0
    stats = {
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed if elapsed else 0.0,
        "bytes": writer.bytes,
        # main-thread seconds inside the backend (queuing on a GPU; the whole computation on the CPU)
        "capture_seconds": capture_s,
        "non_capture_fraction": 1 - capture_s / elapsed if elapsed else 0.0,
        # main-thread seconds waiting for the writer: the share of the run that was write-bound
        "writer_wait_seconds": writer.wait_seconds,
        # the writer threads' seconds, summed: waiting for a sample's states (its copies, or the vllm engine),
        # and writing it (facts, torch.save, sha256)
        "writer_ready_seconds": writer.ready_seconds,
        "writer_write_seconds": writer.write_seconds,
        # their CPU seconds, summed (the rest of their write seconds they waited: for the disk, the GIL)
        "writer_cpu_seconds": writer.cpu_seconds,
    }
    figures = backend.figures()
    if figures:
        stats["backend"] = figures
    if backend.clock is not None:
        stats.update(device_idle(backend.clock.seconds, elapsed))
    return stats


def _checked_items(backend, prepared, batch, seqs, captured, hidden_size, num_layers, done) -> list[Sample]:
    """The writer's items for one captured batch (samples already on disk left out), after checking that the
    backend returned one [T, H] state per layer for every sample."""
    import torch

    states = captured.states
    if len(states) != len(seqs) or any(len(s) != num_layers for s in states):
        raise StageError(
            f"backend {backend.name} returned {len(states)} samples x {[len(s) for s in states][:3]} layers "
            f"for a batch of {len(seqs)} x {num_layers} layers"
        )
    items = []
    scales = captured.scales or [None] * len(states)
    for k, (i, seq, sample_states, sample_scales) in enumerate(
        zip(batch.indices, seqs, states, scales, strict=True)
    ):
        for h in sample_states:
            if h.shape != (len(seq), hidden_size):
                raise StageError(
                    f"sample {i}: backend returned a state of shape {tuple(h.shape)}, "
                    f"expected ({len(seq)}, {hidden_size})"
                )
        if i in done:
            captured.discard(k)
            continue
        ids = torch.from_numpy(seq.astype("int64"))
        mask = torch.from_numpy(prepared.mask(i).astype("int64"))
        items.append(Sample(i, ids, sample_states, mask, captured.ready_of(k), sample_scales))
    return items


def device_idle(busy_seconds: float, wall_seconds: float, devices: int = 1) -> dict:
    """The device's busy seconds and the fraction of the run's wall time (x devices) it sat idle."""
    span = wall_seconds * devices
    return {
        "device_busy_seconds": busy_seconds,
        "device_idle_fraction": max(0.0, 1 - busy_seconds / span) if span else 0.0,
    }


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc, 10 ms steps); None where that cannot be read."""
    try:
        # /proc/self/stat: "pid (comm) state ..." - starttime is field 22, the 20th after the comm's ")"
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def compute_path(backend: Backend) -> dict:
    """The backend and the kernels it ran (data_config.json's ``extra.compute_path``): the hf backend's
    compiled layers, fused RMSNorms or fused MoE experts, the vllm backend's compile."""
    return {
        "backend": backend.name,
        "compiled": bool(getattr(backend, "compiled", False)),
        "fused_norms": bool(getattr(backend, "fused_norms", None)),
        "fused_experts": bool(getattr(backend, "fused_experts", None)),
    }


class FileRate:
    """The launcher's view of its workers' progress: this host's files on disk, and tok/s over the tokens
    written since the first new file appeared (the workers' start-up left out, as a single process's bar
    leaves out its model load)."""

    def __init__(self, owned: set[int], done: set[int], lengths: Sequence[int]):
        self.owned, self.lengths = owned, lengths
        self.seen = set(done)
        self.tokens = 0
        self.first: tuple[float, int] | None = None  # (time, tokens) when the first new file was seen

    def update(self, on_disk: Sequence[int], now: float) -> tuple[int, float]:
        new = (set(on_disk) & self.owned) - self.seen
        self.seen |= new
        self.tokens += sum(int(self.lengths[i]) for i in new)
        if self.first is None and new:
            self.first = (now, self.tokens)
        if self.first is None or now <= self.first[0]:
            return len(self.seen), 0.0
        return len(self.seen), (self.tokens - self.first[1]) / (now - self.first[0])


def first_batch_after(stats: dict) -> tuple[float, float] | None:
    """Seconds from this process's start to the first batch (a data-parallel run: to the first batch of its
    slowest worker that had any), and the model load's share of them (that worker's); None where no batch
    ran or the process age is unknown."""
    startup = stats.get("startup") or {}
    if startup.get("loop_start_seconds") is not None:
        return startup["loop_start_seconds"], startup["model_load_seconds"]
    spawned = startup.get("workers_started_seconds")
    ran = [
        t
        for w in stats.get("workers", [])
        if (t := w.get("startup") or {}).get("loop_start_seconds") is not None
    ]
    if spawned is None or not ran:
        return None
    slowest = max(ran, key=lambda t: t["loop_start_seconds"])
    return spawned + slowest["loop_start_seconds"], slowest["model_load_seconds"]
