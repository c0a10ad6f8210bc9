"""The ``extract`` stage: prepared samples in, one ``data_{i}.pt`` of captured hidden states per sample out.

Owns the extraction loop shared by every backend: the batch plan (length-bucketed, deterministic),
resume (skip batches whose files all exist and belong to this run; a batch is always recomputed whole, so
a resumed run writes the same bytes as an uninterrupted one), the background writer, the progress bar, and
the output directory's bookkeeping (data_config.json, sample_lengths.json, summary.json). How states are
computed is the backend's business (pipeline/backends/).
"""

from __future__ import annotations

import os
import queue
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import click

from contract.shards import shard
from contract.summary import CLOSING_CHECKS
from pipeline import verify
from pipeline.ondisk import integrity
from pipeline.ondisk import formats, provenance
from pipeline.ondisk.atomic import remove_partials
from pipeline.backends import BACKENDS, Backend, BackendOptions, get_backend
from pipeline.backends.base import visible_device_count
from pipeline.errors import StageError
from pipeline.layers import validate_layer_ids
from pipeline.modeldir import check_checkpoint, read_model_dir
from pipeline.options import from_json, opt, options, to_json, validate
from pipeline.ondisk.outdir import output_lock, refuse_overlap

# torch only in annotations here: the functions that use it import it, so that a command that only parses its
# arguments (--help, check-args) never loads it (tests/pipeline/test_cli_imports.py)
if TYPE_CHECKING:
    import torch


# Writer threads per process: on the H200 host (16 cores, tmpfs), 4 left the loop waiting on them (123-144k
# tok/s, 0.1-1.2 s of writer wait per 0.8M tokens) where 8 and 16 kept up (154-164k, no wait; device busy 90%
# of the loop): docs/benchmarks.md, 2026-12-03. Each thread mostly waits in write(2) and sha256, which
# release the GIL, so more threads than cores cost little.
WRITER_THREADS = 8
VLLM_SCRATCH_GLOB = ".vllm-states-*"  # pipeline/backends/vllm.py's per-run scratch folders in --out


@dataclass(frozen=True)
class ExtractConfig:
    """Options of the extract stage (the command line is made from these fields: pipeline/options.py).
    Checks that need no file, model or device run at construction, so `pipeline check-args` refuses them."""

    prepared: Path = opt(help="Output of `pipeline prepare`.")
    model: Path = opt(help="Target model directory.")
    # data_{i}.pt, data_config.json, sample_lengths.json
    out: Path = opt(help="Hidden-states directory to write.")
    backend: str = opt(
        "auto",
        choices=("auto", *BACKENDS),
        help="hf: transformers with hooks; vllm: vLLM's extract_hidden_states; auto: hf where the weights "
        "fit one GPU, vllm where they do not (contract/backends.py says why).",
    )
    layer_ids: tuple[int, ...] | None = opt(
        None, help="Comma-separated decoder layer ids (default 2,L//2,L-3,L-1)."
    )
    device: str = opt("auto", help="auto, cpu, cuda, cuda:N (hf backend).")
    dtype: str = opt("auto", help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float16, float32.")
    max_batch_tokens: int = opt(32768, help="Padded tokens per forward.")
    compile: str = opt(
        "auto",
        choices=("auto", "on", "off"),
        help="torch.compile the model (auto: on a GPU, for runs long enough to repay it; vllm: never "
        "CUDA graphs).",
    )
    max_batch_size: int = opt(64, help="Samples per forward at most.")
    limit: int | None = opt(None, low=1, help="Only the first N samples.")
    resume: bool = opt(False, help="Continue an interrupted run in --out.")
    repair: bool = opt(False, help="With --resume: check existing files and regenerate damaged ones.")
    overwrite: bool = opt(False, help="Delete --out first.")
    tensor_parallel_size: int | None = opt(
        None, low=1, high=4096, help="vllm backend: default all visible devices."
    )
    enforce_eager: bool = opt(
        False, help="vllm backend: no CUDA graphs or torch.compile (faster start, slower loop)."
    )
    trust_remote_code: bool = opt(False, help="Allow the model's own Python code (e.g. Kimi-K2.5).")
    verify: bool = opt(True, decls="--no-verify", help="Skip the summary.json check at the end.")
    closing_check: str = opt(
        "record",
        help="The check writing summary.json: record (each file's size and mtime, and "
        "the values its writer recorded; reads no state back) or full (reads "
        "and hashes every byte, as `pipeline verify`).",
    )
    progress: bool = opt(True, decls="--no-progress", help="No progress bar (logs, CI).")
    writer_threads: int = opt(
        WRITER_THREADS,
        help="Threads writing files (hashing and copying into the page cache), per process.",
    )
    data_parallel: int = opt(
        1, help="Processes on this host: hf one per GPU; vllm one per --tensor-parallel-size GPUs."
    )
    # host `rank` owns samples i with i % world_size == rank
    world_size: int = opt(1, help="Hosts sharing the set (sample i -> host i %% W).")
    rank: int = opt(0, help="This host's rank in --world-size.")
    # set by the launcher for each of its --data-parallel workers (worker_config), never on the command line
    local_rank: int | None = opt(None, cli=False, help="This worker's slot in a --data-parallel run.")

    def __post_init__(self) -> None:
        validate(self)
        if self.max_batch_tokens < 1 or self.max_batch_size < 1:
            raise StageError(
                f"--max-batch-tokens {self.max_batch_tokens} and --max-batch-size {self.max_batch_size} "
                "must be at least 1"
            )
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise StageError(
                f"--rank {self.rank} must be in 0..{self.world_size - 1} for --world-size {self.world_size}"
            )
        if self.closing_check not in CLOSING_CHECKS:
            raise StageError(
                f"unknown --closing-check {self.closing_check!r}: choose {' or '.join(CLOSING_CHECKS)}"
            )
        if self.writer_threads < 1:
            raise StageError(f"--writer-threads {self.writer_threads} must be at least 1")
        if self.data_parallel < 1:
            raise StageError(f"--data-parallel {self.data_parallel} must be at least 1")
        if self.data_parallel > 1 and self.device.startswith("cuda:"):
            raise StageError(
                f"--data-parallel gives each worker one GPU of its own; drop --device {self.device} "
                "(choose the GPUs with CUDA_VISIBLE_DEVICES)"
            )


@dataclass(frozen=True)
class Batch:
    """Sample indices run in one forward, longest first."""

    indices: tuple[int, ...]
    padded_tokens: int


def plan_batches(lengths: Sequence[int], max_batch_tokens: int, max_batch_size: int) -> list[Batch]:
    """Length-bucketed batches: samples sorted by length (longest first, ties by index), packed greedily
    while batch_size x longest <= max_batch_tokens. Pure and deterministic; resume depends on it."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches: list[Batch] = []
    current: list[int] = []
    for i in order:
        longest = int(lengths[current[0]]) if current else int(lengths[i])
        if current and ((len(current) + 1) * longest > max_batch_tokens or len(current) >= max_batch_size):
            batches.append(Batch(tuple(current), len(current) * int(lengths[current[0]])))
            current = []
        current.append(i)
    if current:
        batches.append(Batch(tuple(current), len(current) * int(lengths[current[0]])))
    return batches


def pending_batches(batches: list[Batch], done: set[int]) -> list[Batch]:
    return [b for b in batches if not all(i in done for i in b.indices)]


def shard_indices(num_samples: int, world_size: int, rank: int) -> list[int]:
    """The samples a host owns: i % world_size == rank. Any host count yields one contiguous set."""
    return list(shard(num_samples, rank, world_size))


def plan_shard(
    lengths: Sequence[int], world_size: int, rank: int, max_batch_tokens: int, max_batch_size: int
) -> list[Batch]:
    """The batch plan of one host: its shard's samples, bucketed; global sample indices."""
    owned = shard_indices(len(lengths), world_size, rank)
    local = plan_batches([lengths[i] for i in owned], max_batch_tokens, max_batch_size)
    return [Batch(tuple(owned[j] for j in b.indices), b.padded_tokens) for b in local]


def deal(batches: list[Batch], workers: int, worker: int) -> list[Batch]:
    """A worker's batches: each batch of the longest-first plan goes to the worker with the fewest padded
    tokens so far (ties: lowest worker), so the workers finish together. Pure and deterministic; resume
    depends on it. (Round-robin gave worker 0 the larger batch of every round: 53% vs 47% of the tokens.)"""
    load = [0] * workers
    mine = []
    for b in batches:
        k = min(range(workers), key=lambda w: (load[w], w))
        load[k] += b.padded_tokens
        if k == worker:
            mine.append(b)
    return mine


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
        while (item := self.queue.get()) is not None:
            nbytes = _nbytes(item.states)
            try:
                if self.error is None:
                    # the batch's device-to-host copies (hf), the sample's own file read (vllm), or nothing
                    item.ready()
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
                    f"writing to {self.out} failed: {err.strerror or err} "
                    "(free space, then re-run with --resume)"
                ) from err
            raise err


def _nbytes(states: list[torch.Tensor]) -> int:
    return sum(h.nbytes for h in states)


def _expected_config(
    cfg: ExtractConfig, model, layer_ids, num_samples, seq_length, dtype: torch.dtype
) -> formats.DataConfig:
    return formats.DataConfig(
        model=str(model.path.resolve()),
        layer_ids=list(layer_ids),
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        dtype=str(dtype).removeprefix("torch."),
        num_samples=num_samples,
        seq_length=seq_length,
        prepared=str(cfg.prepared.resolve()),
        backend=cfg.backend,
        provenance=provenance.record("extract"),
    )


def prepare_output_dir(
    cfg: ExtractConfig,
    expected: formats.DataConfig,
    prepared: formats.PreparedSamples | None = None,
    owned: set[int] | None = None,
) -> set[int]:
    """Apply the --resume/--overwrite policy; return the sample indices already complete.

    --resume continues a run only if its data_config.json is this run's and each existing file it would skip
    (those of ``owned``, this host's samples; default all) belongs to this run
    (``integrity.foreign_files``: the file mapped, not read: its input_ids and loss_mask against prepared row
    i, its states' count, shapes and dtype against this run's config; its size, and its bytes only if it
    changed after the set's checksum records, against them). Either refusal is one line, before anything in
    --out changes. --resume --repair instead reads every byte of every file (``integrity.damaged_files``) and
    regenerates the ones that fail."""
    out = cfg.out
    refuse_overlap(out, {"--prepared": cfg.prepared, "--model": cfg.model})
    existing = formats.existing_data_indices(out)
    has_config = (out / formats.DATA_CONFIG).exists()
    if cfg.resume and cfg.overwrite:
        raise StageError("--resume and --overwrite contradict each other: choose one")
    if cfg.repair and not cfg.resume:
        raise StageError("--repair works on an existing run: pass it together with --resume")
    if out.exists() and not out.is_dir():
        raise StageError(f"output {out} exists and is not a directory: choose another --out")
    if (existing or has_config or (out.is_dir() and any(out.iterdir()))) and not (
        cfg.resume or cfg.overwrite
    ):
        raise StageError(
            f"output dir {out} is not empty: pass --resume to continue it or --overwrite to replace it"
        )
    if cfg.resume and has_config:
        found = formats.read_data_config(out)
        mismatch = formats.resume_mismatch(found, expected)
        if mismatch:
            raise StageError(
                f"cannot --resume {out}: its data_config.json has {mismatch}; "
                "use --overwrite or another --out"
            )
        expected.provenance_history = [
            *found.provenance_history,
            *([found.provenance] if found.provenance else []),
        ]
    kept = [i for i in existing if i < expected.num_samples and (owned is None or i in owned)]
    if prepared is None and kept and cfg.resume:
        prepared = formats.read_prepared(cfg.prepared)[0]
    if cfg.resume and not cfg.repair and kept:
        refuse_foreign_files(out, kept, expected, prepared)
    if cfg.overwrite and out.is_dir():
        shutil.rmtree(out)
        existing, has_config = [], False
    out.mkdir(parents=True, exist_ok=True)
    remove_partials(out)
    for stale in out.glob(VLLM_SCRATCH_GLOB):  # the vllm backend's files of a run that was killed
        shutil.rmtree(stale, ignore_errors=True)
    formats.write_data_config(out, expected)
    if cfg.repair:
        bad = integrity.damaged_files(out, kept, expected, prepared)
        for i, reason in sorted(bad.items()):
            click.echo(f"repair: data_{i}.pt will be regenerated ({reason})", err=True)
            formats.data_file(out, i).unlink()
        existing = [i for i in existing if i not in bad]
    return set(existing)


def refuse_foreign_files(out: Path, indices: list[int], expected: formats.DataConfig, prepared) -> None:
    """One line naming the first of ``indices`` that is not this run's file (and how many more there are)."""
    foreign = integrity.foreign_files(out, indices, expected, prepared)
    if foreign:
        first = min(foreign)
        more = f" (and {len(foreign) - 1} more files)" if len(foreign) > 1 else ""
        raise StageError(
            f"cannot --resume {out}: {formats.data_file(out, first).name} is not this run's file "
            f"({foreign[first]}){more}: "
            "pass --repair with --resume to regenerate such files, or --overwrite to start over"
        )


def _progress(enabled: bool):
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
    t0 = time.perf_counter()
    try:
        return _loop(backend, prepared, batches, writer, hidden_size, num_layers, total, done, progress, t0)
    except BaseException:
        writer.abort()
        raise


def _loop(backend, prepared, batches, writer, hidden_size, num_layers, total, done, progress, t0) -> dict:
    tokens, capture_s = 0, 0.0
    with _progress(progress) as bar:
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
    }
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


def _check_parallel(cfg: ExtractConfig) -> None:
    """What only this host can say of the options (the rest is checked at construction): enough GPUs."""
    import torch

    if cfg.data_parallel > 1 and cfg.local_rank is None and torch.cuda.is_available():
        per = gpus_per_worker(cfg, len(visible_devices()))
        if per < 1 or cfg.data_parallel * per > len(visible_devices()):
            raise StageError(
                f"--data-parallel {cfg.data_parallel} x {per} GPU(s) per worker but only "
                f"{len(visible_devices())} GPUs are visible: lower --data-parallel or --tensor-parallel-size"
            )


def gpus_per_worker(cfg: ExtractConfig, visible: int) -> int:
    """GPUs each data-parallel worker gets: one for hf; for vllm its tensor parallel size (default: the
    visible GPUs split evenly between the workers)."""
    if cfg.backend != "vllm":
        return 1
    return cfg.tensor_parallel_size or visible // cfg.data_parallel


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc, 10 ms steps); None where that cannot be read."""
    try:
        # /proc/self/stat: "pid (comm) state ..." - starttime is field 22, the 20th after the comm's ")"
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def visible_devices() -> list[str]:
    import torch

    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d for d in env.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def run(cfg: ExtractConfig) -> dict:
    import torch

    # where a run's time goes before its loop (interpreter and imports, model load): reported in the stats
    startup = {"imports_seconds": process_age()}
    if cfg.backend == "auto":
        from pipeline.backends.choice import resolve

        choice = resolve(cfg.backend, cfg.model)
        # said on stdout beside the closing line (stderr carries only a failure's one `error:` line)
        startup["backend_choice"] = f"backend {choice.backend}: {choice.reason}"
        cfg = replace(cfg, backend=choice.backend)
    _check_parallel(cfg)
    prepared, meta = formats.read_prepared(cfg.prepared)
    model = read_model_dir(cfg.model)
    check_checkpoint(model)  # every layer the config claims has weights, none is left unused
    if meta.target_vocab_size != model.vocab_size:
        raise StageError(
            f"{cfg.prepared} was prepared for a vocab of {meta.target_vocab_size}, "
            f"but {cfg.model} has {model.vocab_size}: re-run prepare with this model"
        )
    layer_ids = validate_layer_ids(cfg.layer_ids, model.num_layers)
    if cfg.backend not in BACKENDS:
        raise StageError(f"unknown --backend {cfg.backend!r}: choose one of {', '.join(BACKENDS)}")
    n = len(prepared) if cfg.limit is None else min(cfg.limit, len(prepared))
    if n <= 0:
        raise StageError(f"--limit {cfg.limit} selects no samples")
    lengths = prepared.lengths()[:n]
    options = BackendOptions(
        model=model,
        layer_ids=tuple(layer_ids),
        device=cfg.device,
        dtype=cfg.dtype,
        seq_length=meta.seq_length,
        tensor_parallel_size=cfg.tensor_parallel_size,
        max_batch_tokens=cfg.max_batch_tokens,
        trust_remote_code=cfg.trust_remote_code,
        enforce_eager=cfg.enforce_eager,
        scratch_dir=cfg.out,
        compile={"auto": None, "on": True, "off": False}[cfg.compile],
    )
    from pipeline.backends.base import resolve_device, resolve_dtype

    dtype = (
        resolve_dtype(cfg.dtype, resolve_device(cfg.device))
        if cfg.backend == "hf"
        else resolve_dtype("bfloat16" if cfg.dtype == "auto" else cfg.dtype, torch.device("cpu"))
    )
    expected = _expected_config(cfg, model, layer_ids, n, meta.seq_length, dtype)
    plan = plan_shard(lengths, cfg.world_size, cfg.rank, cfg.max_batch_tokens, cfg.max_batch_size)
    owned = {i for b in plan for i in b.indices}
    if cfg.local_rank is None:
        done = prepare_output_dir(cfg, expected, prepared, owned)
    else:  # a worker: the launcher applied the output policy; it only re-reads what exists
        done = set(formats.existing_data_indices(cfg.out))
    done &= owned
    if cfg.local_rank is not None:
        # deal the whole plan, not the pending part: workers list the directory at different moments
        plan = deal(plan, cfg.data_parallel, cfg.local_rank)
    if cfg.local_rank is None:
        record_missing_checksums(cfg.out, done)
    batches = pending_batches(plan, done)
    stats = {"tokens": 0, "seconds": 0.0, "tokens_per_s": 0.0, "bytes": 0}
    if batches and cfg.data_parallel > 1 and cfg.local_rank is None:
        stats = launch_workers(cfg, owned, done, lengths, startup)
    elif batches:
        if "OMP_NUM_THREADS" not in os.environ and visible_device_count() > 0:
            # the host side of a GPU run is copies; an OpenMP pool of every core slowed the hf backend 2x on
            # a 32-core H200 host (docs/benchmarks.md), half the cores (at most 16) did not. The vllm
            # backend's host side is the same kind of work (each writer thread writes a sample's states),
            # so it gets the same cap; at tensor parallel 1 its engine runs in this process, on the GPU
            torch.set_num_threads(max(1, min(16, (os.cpu_count() or 2) // 2)))
        load0 = time.perf_counter()
        options = replace(options, planned_tokens=sum(int(lengths[i]) for b in batches for i in b.indices))
        with get_backend(cfg.backend, options) as backend:
            startup.update(model_load_seconds=time.perf_counter() - load0, loop_start_seconds=process_age())
            # how the states were computed, so that `verify --model` recomputes them the same way (bf16 paths
            # that round differently drift apart at deep layers: 10-11% on random 8B weights, H200)
            expected.extra["compute_path"] = compute_path(backend)
            stats = run_loop(
                backend,
                prepared,
                batches,
                cfg.out,
                model.hidden_size,
                len(layer_ids),
                len(owned),
                done,
                cfg.progress,
                cfg.writer_threads,
            )
    if cfg.local_rank is None:
        formats.write_sample_lengths(cfg.out, {i: int(lengths[i]) for i in range(n)})
        formats.fold_checksums(cfg.out, owned, cfg.world_size, cfg.rank)
        expected.provenance = provenance.record("extract")  # its finished time: now
        formats.write_data_config(cfg.out, expected)
    stats.update(
        samples=n, owned=len(owned), batches_run=len(batches), resumed_from=len(done), config=asdict(expected)
    )
    stats.setdefault("startup", startup)
    return stats


def compute_path(backend: Backend) -> dict:
    """The backend and the kernels it ran (data_config.json's ``extra.compute_path``): the hf backend's
    compiled layers or fused RMSNorms, the vllm backend's compile."""
    return {
        "backend": backend.name,
        "compiled": bool(getattr(backend, "compiled", False)),
        "fused_norms": bool(getattr(backend, "fused_norms", None)),
    }


def record_missing_checksums(out: Path, done: set[int]) -> None:
    """Resume: record the files already complete that no index or journal records (written before checksums
    existed, or by a run killed between a file's rename and its journal line), so that every file has one;
    and record again, with their current mtime, the files whose record's mtime or size they no longer have
    (copied, or touched) while their bytes are still the recorded ones. Each is read once: its sha256 and,
    where it reads as a sample, its value facts. A file whose bytes differ from its record keeps that record
    (the closing check names it: ``refuse_foreign_files`` hashes only files changed after the records);
    files recorded by an older extract without facts are left as they are (the closing check reads them)."""
    recorded = formats.read_checksums(out)

    def stale(i: int) -> bool:
        path, want = formats.data_file(out, i), recorded.get(formats.data_file(out, i).name)
        if want is None:
            return True
        st = path.stat()
        return integrity.has_facts(want) and (st.st_mtime_ns != want.mtime_ns or st.st_size != want.bytes)

    missing = sorted(i for i in done if stale(i))
    if not missing:
        return
    click.echo(
        f"resume: recording the checksums of {len(missing)} files written without one (or changed since)",
        err=True,
    )
    journal, load = formats.ChecksumJournal(out), integrity.reader_loads()
    try:
        for i in missing:
            path = formats.data_file(out, i)
            mtime = path.stat().st_mtime_ns
            try:
                d, digest = load(path)
                facts = integrity.written_facts(d["input_ids"], d["hidden_states"], d["loss_mask"])
            except Exception:  # noqa: BLE001 - not a readable sample: its checksum only; the closing check reads it
                digest, facts = formats.file_digest(path), None
            if (want := recorded.get(path.name)) is not None and digest.sha256 != want.sha256:
                # other bytes than recorded under an old mtime (not hashed by the resume check): kept as named
                continue
            journal.record(
                path.name, replace(digest, mtime_ns=mtime if facts is not None else None, facts=facts)
            )
    finally:
        journal.close()


def worker_config(cfg: ExtractConfig, local_rank: int, tensor_parallel_size: int = 1) -> ExtractConfig:
    """One data-parallel worker's config: the launcher's own, told which slice of the plan is its
    (``local_rank``) and, for vllm, the tensor parallel size over its GPUs; the closing check and the bar
    stay with the launcher."""
    tp = tensor_parallel_size if cfg.backend == "vllm" else cfg.tensor_parallel_size
    return replace(cfg, local_rank=local_rank, tensor_parallel_size=tp, verify=False, progress=False)


WORKER_ARGV = [sys.executable, "-m", "pipeline", "extract-worker"]  # its config on stdin (worker_command)


def launch_workers(
    cfg: ExtractConfig, owned: set[int], done: set[int], lengths: Sequence[int], startup: dict
) -> dict:
    """Run one worker process per GPU (or per CPU slot), show their combined progress, fail if any fails.
    ``startup`` (this process's timeline) gains the moment the workers were started. The figures are a
    single process's: tok/s over the slowest worker's loop; the workers' start-up is in ``startup``."""
    import json
    import subprocess

    import torch

    devices = visible_devices() if torch.cuda.is_available() else []
    per = gpus_per_worker(cfg, len(devices)) if devices else 1
    procs = []
    t0 = time.perf_counter()
    for k in range(cfg.data_parallel):
        env = dict(os.environ)
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[k * per : (k + 1) * per])
        # each worker's OpenMP pool gets its share of the cores (host copies, CPU forward): N pools of
        # all cores oversubscribe the machine
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.data_parallel)))
        proc = subprocess.Popen(
            WORKER_ARGV, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        proc.stdin.write(to_json(worker_config(cfg, k, per)))
        proc.stdin.close()
    startup["workers_started_seconds"] = process_age()
    failed = []
    try:
        with _progress(cfg.progress) as bar:
            task = bar.add_task("extract", total=len(owned), completed=len(done), tps=0.0)
            rate = FileRate(owned, done, lengths)
            while any(p.poll() is None for p in procs):
                time.sleep(0.5)
                count, tps = rate.update(formats.existing_data_indices(cfg.out), time.perf_counter())
                bar.update(task, completed=count, tps=tps)
        outputs = [p.stdout.read() for p in procs]  # each ended; its stdin (the config) is closed already
        for p in procs:
            p.wait()
    except BaseException:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        raise
    for k, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        if p.returncode != 0:
            failed.append(f"worker {k} exited {p.returncode}")
    if failed:
        raise StageError(
            f"data-parallel extraction failed: {'; '.join(failed)} "
            "(re-run with --resume to redo what is missing)"
        )
    per = [json.loads(o.strip().splitlines()[-1]) for o in outputs]
    tokens = sum(w["tokens"] for w in per)
    loop = max(
        w["seconds"] for w in per
    )  # the workers' loops run side by side: the slowest one's is the run's
    stats = {
        "tokens": tokens,
        "seconds": loop,
        "tokens_per_s": tokens / loop if loop else 0.0,
        "wall_seconds": time.perf_counter() - t0,
        "bytes": sum(w["bytes"] for w in per),
        "workers": per,
        "startup": startup,
    }
    busy = [w["device_busy_seconds"] for w in per if "device_busy_seconds" in w]
    if len(busy) == len(
        per
    ):  # over the workers' loops: their start-up and model loads are not the loop's idle time
        stats.update(device_idle(sum(busy), sum(w["seconds"] for w in per)))
    return stats


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


@click.command("extract")
@options(ExtractConfig)
@click.option(
    "--json-stats", is_flag=True, hidden=True, help="Print the run's figures as one JSON line (benchmarks)."
)
def command(json_stats: bool, **kwargs) -> None:
    """Capture the outputs of 4 decoder layers for every prepared sample."""
    cfg = ExtractConfig(**kwargs)
    shard = f"rank-{cfg.rank}" if cfg.world_size > 1 else ""
    with output_lock(cfg.out, shard):
        stats = run(cfg)
    if json_stats:
        echo_stats(stats)
        return
    started = first_batch_after(stats)
    click.echo(
        f"extracted {stats['samples']} samples into {cfg.out} ({stats['batches_run']} batches run, "
        f"{stats['resumed_from']} already done; {stats['tokens_per_s']:,.0f} tok/s"
        + (f", device idle {stats['device_idle_fraction']:.0%}" if "device_idle_fraction" in stats else "")
        + (
            f"; first batch {started[0]:.1f} s after start, model load {started[1]:.1f} s)"
            if started
            else ")"
        )
    )
    choice = (stats.get("startup") or {}).get("backend_choice")
    if choice:
        click.echo(f"extract: --backend auto chose {choice}")
    if cfg.verify:
        verify.report(
            verify.VerifyConfig(
                path=cfg.out, world_size=cfg.world_size, rank=cfg.rank, closing_check=cfg.closing_check
            )
        )


@click.command("extract-worker", hidden=True)
def worker_command() -> None:
    """One data-parallel worker of `pipeline extract` (launch_workers starts it): its ExtractConfig as JSON on
    stdin, its figures as one JSON line on stdout."""
    cfg = from_json(ExtractConfig, sys.stdin.read())
    if cfg.local_rank is None:
        raise StageError(
            "extract-worker runs one worker of a --data-parallel extract: its config has no local_rank"
        )
    echo_stats(run(cfg))


def echo_stats(stats: dict) -> None:
    """A run's figures (its resolved config left out) as one JSON line: what launch_workers and the
    benchmarks read."""
    import json

    click.echo(json.dumps({k: v for k, v in stats.items() if k != "config"}))
