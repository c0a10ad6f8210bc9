"""The ``extract`` stage: prepared samples in, one ``data_{i}.pt`` of captured hidden states per sample out.

Owns the extraction loop shared by every backend: the batch plan (length-bucketed, deterministic),
resume (skip batches whose files all exist; a batch is always recomputed whole, so a resumed run writes
the same bytes as an uninterrupted one), the background writer, the progress bar, and the output
directory's bookkeeping (data_config.json, sample_lengths.json, summary.json). How states are computed
is the backend's business (pipeline/backends/).
"""

from __future__ import annotations

import queue
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import torch

from pipeline import formats
from pipeline.atomic import remove_partials
from pipeline.backends import BACKENDS, Backend, BackendOptions, get_backend
from pipeline.errors import StageError
from pipeline.layers import parse_layer_ids, validate_layer_ids
from pipeline.modeldir import read_model_dir


@dataclass(frozen=True)
class ExtractConfig:
    """Options of the extract stage."""

    prepared: Path  # output of `pipeline prepare`
    model: Path  # target model directory
    out: Path  # hidden-states directory (data_{i}.pt, data_config.json, sample_lengths.json)
    backend: str = "hf"  # hf | vllm
    layer_ids: tuple[int, ...] | None = None  # default [2, L//2, L-3, L-1]
    device: str = "auto"
    dtype: str = "auto"  # auto = bf16 on GPU, fp32 on CPU
    max_batch_tokens: int = 16384  # padded tokens per forward
    max_batch_size: int = 64
    limit: int | None = None  # only the first N samples
    resume: bool = False
    overwrite: bool = False
    tensor_parallel_size: int | None = None  # vllm only
    trust_remote_code: bool = False
    verify: bool = True  # write summary.json by running verify at the end
    progress: bool = True


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


class Writer:
    """Writes samples on background threads so the device computes the next batch meanwhile.

    Several threads: torch.save spends most of its time in memcpy and write(2), which release the GIL.
    """

    def __init__(self, out: Path, threads: int = 4, depth: int = 4):
        self.out = out
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.bytes = 0
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, name=f"extract-writer-{n}", daemon=True) for n in range(threads)]
        for t in self.threads:
            t.start()

    def _loop(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.error is not None:
                continue
            try:
                index, ids, states, mask = item
                target = formats.data_file(self.out, index)
                formats.write_sample(target, ids, states, mask)
                size = target.stat().st_size
                with self._lock:
                    self.bytes += size
            except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
                self.error = exc

    def put(self, items: list) -> None:
        for item in items:
            self._raise()
            self.queue.put(item)

    def close(self) -> None:
        for _ in self.threads:
            self.queue.put(None)
        for t in self.threads:
            t.join()
        self._raise()

    def abort(self) -> None:
        """Stop the threads after an error on the main thread; queued samples are dropped, none half-written."""
        self.error = self.error or RuntimeError("aborted")
        try:
            while True:
                self.queue.get_nowait()
        except queue.Empty:
            pass
        for _ in self.threads:
            self.queue.put(None)
        for t in self.threads:
            t.join()

    def _raise(self) -> None:
        if self.error is not None:
            err = self.error
            if isinstance(err, OSError):
                raise StageError(f"writing to {self.out} failed: {err.strerror or err} (free space, then re-run with --resume)") from err
            raise err


def _expected_config(cfg: ExtractConfig, model, layer_ids, num_samples, seq_length, dtype: torch.dtype) -> formats.DataConfig:
    return formats.DataConfig(
        model=str(model.path.resolve()), layer_ids=list(layer_ids), num_layers=model.num_layers,
        hidden_size=model.hidden_size, dtype=str(dtype).removeprefix("torch."), num_samples=num_samples,
        seq_length=seq_length, prepared=str(cfg.prepared.resolve()), backend=cfg.backend,
    )


def prepare_output_dir(cfg: ExtractConfig, expected: formats.DataConfig) -> set[int]:
    """Apply the --resume/--overwrite policy; return the sample indices already complete."""
    out = cfg.out
    existing = formats.existing_data_indices(out)
    has_config = (out / formats.DATA_CONFIG).exists()
    if cfg.resume and cfg.overwrite:
        raise StageError("--resume and --overwrite contradict each other: choose one")
    if out.exists() and not out.is_dir():
        raise StageError(f"output {out} exists and is not a directory: choose another --out")
    if (existing or has_config or (out.is_dir() and any(out.iterdir()))) and not (cfg.resume or cfg.overwrite):
        raise StageError(f"output dir {out} is not empty: pass --resume to continue it or --overwrite to replace it")
    if cfg.overwrite and out.is_dir():
        shutil.rmtree(out)
        existing, has_config = [], False
    out.mkdir(parents=True, exist_ok=True)
    remove_partials(out)
    if cfg.resume and has_config:
        found = formats.read_data_config(out)
        keys = ("model", "layer_ids", "hidden_size", "dtype", "num_samples", "seq_length", "prepared")
        diff = [k for k in keys if getattr(found, k) != getattr(expected, k)]
        if diff:
            k = diff[0]
            raise StageError(
                f"cannot --resume {out}: its data_config.json has {k}={getattr(found, k)!r} but this run has "
                f"{getattr(expected, k)!r}; use --overwrite or another --out"
            )
    formats.write_data_config(out, expected)
    return set(existing)


def _progress(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]extract"), BarColumn(), MofNCompleteColumn(), TextColumn("samples"),
        TextColumn("{task.fields[tps]:>9,.0f} tok/s"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        disable=not enabled, transient=False,
    )


def run_loop(backend: Backend, prepared: formats.PreparedSamples, batches: list[Batch], out: Path, hidden_size: int,
             num_layers: int, total: int, done: int, progress: bool) -> dict:
    """Capture and write every pending batch; return throughput figures."""
    writer = Writer(out)
    t0 = time.perf_counter()
    try:
        return _loop(backend, prepared, batches, writer, hidden_size, num_layers, total, done, progress, t0)
    except BaseException:
        writer.abort()
        raise


def _loop(backend, prepared, batches, writer, hidden_size, num_layers, total, done, progress, t0) -> dict:
    tokens, capture_s = 0, 0.0
    with _progress(progress) as bar:
        task = bar.add_task("extract", total=total, completed=done, tps=0.0)
        for batch in batches:
            seqs = [prepared.ids(i) for i in batch.indices]
            c0 = time.perf_counter()
            states = backend.capture([s.tolist() for s in seqs])
            capture_s += time.perf_counter() - c0
            if len(states) != len(seqs) or any(len(s) != num_layers for s in states):
                raise StageError(
                    f"backend {backend.name} returned {len(states)} samples x {[len(s) for s in states][:3]} layers "
                    f"for a batch of {len(seqs)} x {num_layers} layers"
                )
            items = []
            for i, seq, sample_states in zip(batch.indices, seqs, states, strict=True):
                for h in sample_states:
                    if h.shape != (len(seq), hidden_size):
                        raise StageError(f"sample {i}: backend returned a state of shape {tuple(h.shape)}, expected ({len(seq)}, {hidden_size})")
                ids = torch.from_numpy(seq.astype("int64"))
                mask = torch.from_numpy(prepared.mask(i).astype("int64"))
                items.append((i, ids, sample_states, mask))
            writer.put(items)
            tokens += sum(len(s) for s in seqs)
            elapsed = time.perf_counter() - t0
            bar.update(task, advance=len(seqs), tps=tokens / elapsed if elapsed else 0.0)
        writer.close()
    elapsed = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed if elapsed else 0.0, "bytes": writer.bytes,
            # time the main thread spent waiting for anything but the backend (queue full, progress, checks)
            "capture_seconds": capture_s, "non_capture_fraction": 1 - capture_s / elapsed if elapsed else 0.0}


def run(cfg: ExtractConfig) -> dict:
    prepared, meta = formats.read_prepared(cfg.prepared)
    model = read_model_dir(cfg.model)
    if meta.target_vocab_size != model.vocab_size:
        raise StageError(f"{cfg.prepared} was prepared for a vocab of {meta.target_vocab_size}, but {cfg.model} has {model.vocab_size}: re-run prepare with this model")
    layer_ids = validate_layer_ids(cfg.layer_ids, model.num_layers)
    if cfg.backend not in BACKENDS:
        raise StageError(f"unknown --backend {cfg.backend!r}: choose one of {', '.join(BACKENDS)}")
    n = len(prepared) if cfg.limit is None else min(cfg.limit, len(prepared))
    if n <= 0:
        raise StageError(f"--limit {cfg.limit} selects no samples")
    lengths = prepared.lengths()[:n]
    options = BackendOptions(
        model=model, layer_ids=tuple(layer_ids), device=cfg.device, dtype=cfg.dtype, seq_length=meta.seq_length,
        tensor_parallel_size=cfg.tensor_parallel_size, max_batch_tokens=cfg.max_batch_tokens,
        trust_remote_code=cfg.trust_remote_code,
    )
    from pipeline.backends.base import resolve_device, resolve_dtype

    dtype = resolve_dtype(cfg.dtype, resolve_device(cfg.device)) if cfg.backend == "hf" else resolve_dtype(
        "bfloat16" if cfg.dtype == "auto" else cfg.dtype, torch.device("cpu"))
    expected = _expected_config(cfg, model, layer_ids, n, meta.seq_length, dtype)
    done = prepare_output_dir(cfg, expected)
    done &= set(range(n))
    batches = pending_batches(plan_batches(lengths, cfg.max_batch_tokens, cfg.max_batch_size), done)
    stats = {"tokens": 0, "seconds": 0.0, "tokens_per_s": 0.0, "bytes": 0}
    if batches:
        with get_backend(cfg.backend, options) as backend:
            stats = run_loop(backend, prepared, batches, cfg.out, model.hidden_size, len(layer_ids), n,
                             len(done - {i for b in batches for i in b.indices}), cfg.progress)
    formats.write_sample_lengths(cfg.out, {i: int(lengths[i]) for i in range(n)})
    stats.update(samples=n, batches_run=len(batches), resumed_from=len(done), config=asdict(expected))
    return stats


@click.command("extract")
@click.option("--prepared", type=click.Path(path_type=Path), required=True, help="Output of `pipeline prepare`.")
@click.option("--model", type=click.Path(path_type=Path), required=True, help="Target model directory.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Hidden-states directory to write.")
@click.option("--backend", type=click.Choice(BACKENDS), default="hf", show_default=True)
@click.option("--layer-ids", default=None, help="Comma-separated decoder layer ids (default 2,L//2,L-3,L-1).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:N (hf backend).")
@click.option("--dtype", default="auto", show_default=True, help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float16, float32.")
@click.option("--max-batch-tokens", type=int, default=16384, show_default=True, help="Padded tokens per forward.")
@click.option("--max-batch-size", type=int, default=64, show_default=True)
@click.option("--limit", type=int, default=None, help="Only the first N samples.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run in --out.")
@click.option("--overwrite", is_flag=True, help="Delete --out first.")
@click.option("--tensor-parallel-size", type=int, default=None, help="vllm backend: default all visible devices.")
@click.option("--trust-remote-code", is_flag=True)
@click.option("--no-verify", "verify", is_flag=True, flag_value=False, default=True, help="Skip the summary.json check at the end.")
@click.option("--no-progress", "progress", is_flag=True, flag_value=False, default=True)
def command(layer_ids: str | None, **kwargs) -> None:
    """Capture the outputs of 4 decoder layers for every prepared sample."""
    cfg = ExtractConfig(layer_ids=tuple(ids) if (ids := parse_layer_ids(layer_ids)) else None, **kwargs)
    stats = run(cfg)
    click.echo(
        f"extracted {stats['samples']} samples into {cfg.out} ({stats['batches_run']} batches run, "
        f"{stats['resumed_from']} already done; {stats['tokens_per_s']:,.0f} tok/s)"
    )
    if cfg.verify:
        from pipeline.verify import VerifyConfig, report

        report(VerifyConfig(path=cfg.out))
