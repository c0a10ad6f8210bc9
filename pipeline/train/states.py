"""States produced while the draft trains (``pipeline train --states-mode online|hybrid``), disk held to a
budget.

Owns, for the modes in which no finished hidden-states set exists:

* the plan, pure (``plan_states``, ``epoch_batches``, ``production_order``, ``next_chunk``): which samples'
  states stay on disk for the whole run (the held-out ones always: validation reads them every epoch and
  the acceptance measurement at the end; in ``hybrid`` also as many training samples as the budget holds
  beside a producing window), the order in which the trainer will read the others (speculators' own sampler,
  replayed: with torchrun, every rank's sampler, their batches interleaved step by step), and how the
  producer groups them into forwards;
* the states dir (``--data``): the same ``data_{i}.pt`` files, ``data_config.json`` and
  ``sample_lengths.json`` that ``pipeline extract`` writes, the data config recording the mode, the budget
  and the kept samples (``extra["states"]``) so that ``pipeline verify`` checks exactly the kept files; the
  kept files' checksums in the extract journal and index; resume (partial files and transient states of a
  killed run removed, kept files proved to be this run's or produced again);
* ``Producer``: a thread that runs a ``Backend`` (the extract backends' interface: hf or vllm,
  ``--states-backend``) over the samples in the order the trainer reads them and writes each with
  ``formats.write_sample``, never letting the state files on disk (kept, waiting and being written, and the
  vllm engine's per-request files when its scratch folder is in the states dir: ``disk_bytes``) exceed the
  budget: it waits for the trainer to use and delete waiting files (back-pressure in bytes);
* ``wait_for``: a reader's wait for a produced file (pipeline/train/datasets.py ``ProducedDataset``, the
  trainer's dataset, reads it whole and deletes it when it is transient, in the trainer's loader workers);
* ``Heartbeat``: rank 0's process, alive, as a file the readers of other processes watch (``wait_for``
  ends when it stops moving and the process it names is gone: rank 0 was killed and nobody marked the run
  failed).

It does not train (pipeline/train/stage.py) and does not change how states are computed: the backend
(pipeline/backends/) and the file format (pipeline/ondisk/formats.py) are extract's. Data parallel
(torchrun): one producer, in rank 0, for every rank's reads; each rank's readers wait for, read and delete
its own files, and those of the other ranks learn of a failed producer from its FAILED file
(``reported_failure``), or from its heartbeat when rank 0 died without writing one (SIGKILLed together with
torchrun's agent, which would otherwise have ended them); the budget bounds the files of all ranks together.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipeline.errors import StageError
from pipeline.ondisk import formats

MODES = ("offline", "online", "hybrid")
# bytes a data_{i}.pt holds beyond its tensors' payload: torch's zip records and pickle; measured 2.5-2.7 KB
# for every length, width and dtype (tests/train/test_states.py holds the bound)
FILE_OVERHEAD = 4096
FAILED = ".producer-failed"  # the producer's error, for a reader waiting on a file that will not come
DONE = ".producer-done"  # the producer finished its schedule: a file still missing then is an error
ALIVE = ".producer-alive"  # rank 0's process touches it every HEARTBEAT_S while the run may produce
HEARTBEAT_S = 2.0
# a reader that sees ALIVE unmoved this long (by its own clock) asks whether rank 0's process is still there
# (same host: its pid and start time); only a gone process ends the wait, never a stopped or starved one
STALE_S = 10.0
# a reader on another host than rank 0 (a shared states dir) has no process to ask: this much silence decides,
# 30 missed beats
STALE_REMOTE_S = 60.0
# how a reader's verdict on a silent heartbeat starts (``rank0_gone``)
ORPHANED = "rank 0's process stopped without ending the run"
WAIT_POLL_S = 0.005
# a producer's error by states dir, for readers in its own process (the FAILED file is for worker processes,
# and may not be writable on a full disk)
_FAILED_HERE: dict[str, str] = {}
# readers' shared flags by states dir (set when the producer fails): a loader worker in another process waits
# on one, since on a full disk the FAILED file may never be written
_READER_FLAGS: dict[str, list] = {}
WINDOW_SHARE = 8  # hybrid: at least 1/8 of the budget left after the held-out states is the producer's window
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str, flag: str = "--states-budget") -> int:
    """``"500G"`` -> 500e9 bytes; decimal units (k, M, G, T, with or without B) and binary ones (KiB, MiB,
    GiB, TiB); a bare number is bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise StageError(f"{flag} {text!r} is not a size: write e.g. 500G, 2T, 64GiB or a number of bytes")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise StageError(f"{flag} {text!r} must be more than 0 bytes")
    return value


def sample_bytes(length: int, hidden: int, layers: int, dtype_bytes: int) -> int:
    """An upper bound on one ``data_{i}.pt``'s size: its states, int64 ids and mask, the file's records."""
    return layers * length * hidden * dtype_bytes + 16 * length + FILE_OVERHEAD


def engine_file_bytes(length: int, hidden: int, layers: int, dtype_bytes: int) -> int:
    """An upper bound on the vllm backend's per-request file of one sample (its connector's layout,
    pipeline/backends/vllm_connector.py: per layer the states, a float32 rms and an int32 count per token;
    the int64 ids; safetensors' JSON header, well under FILE_OVERHEAD for a few layers)."""
    return layers * length * (hidden * dtype_bytes + 8) + 8 * length + FILE_OVERHEAD


def disk_bytes(length: int, hidden: int, layers: int, dtype_bytes: int, backend: str) -> int:
    """What producing one sample may hold on disk at once: its file and, with the vllm backend, first the
    engine's file of it (read and deleted before the sample's own file is written: the larger of the two)."""
    own = sample_bytes(length, hidden, layers, dtype_bytes)
    if backend != "vllm":
        return own
    return max(own, engine_file_bytes(length, hidden, layers, dtype_bytes))


# ---------------------------------------------------------------- the plan (pure)


@dataclass(frozen=True)
class StatesPlan:
    """What stays on disk for the whole run, and the room left for states that wait to be read."""

    mode: str
    budget: int
    keep: frozenset[int]  # sample indices whose files are kept once produced
    kept_bytes: int  # their sizes' bound
    window: int  # budget - kept_bytes: the producer's room for transient states

    def record(self) -> dict:
        """What data_config.json's ``extra["states"]`` holds (verify reads ``kept``)."""
        return {
            "mode": self.mode,
            "budget": self.budget,
            "kept": sorted(self.keep),
            "kept_bytes_bound": self.kept_bytes,
        }


def plan_states(
    mode: str,
    budget: int,
    sizes: Sequence[int],
    train: Sequence[int],
    held_out: Sequence[int],
    measured: Sequence[int] = (),
) -> StatesPlan:
    """The keep set under ``budget`` (``sizes``: each sample's ``disk_bytes``). The held-out samples are
    always kept, and ``measured`` (the training samples the acceptance measurement reads for its unigram
    baseline, pipeline/train/evaluate.py); ``online`` keeps nothing else; ``hybrid`` keeps training samples
    in index order while a window of at least the largest training sample and 1/WINDOW_SHARE of the rest of
    the budget stays free for the producer. Refuses a budget that cannot hold what is always kept and one
    training sample."""
    if mode not in ("online", "hybrid"):
        raise StageError(f"--states-mode {mode!r}: states are planned for online or hybrid only")
    always = set(held_out) | set(measured)
    held = sum(sizes[i] for i in always)
    largest = max((sizes[i] for i in train), default=0)
    need = held + largest
    if budget < need:
        baseline = len(set(measured) - set(held_out))
        raise StageError(
            f"--states-budget {budget:,} bytes cannot hold the states kept for the whole run ({held:,} "
            f"bytes: {len(held_out)} held-out samples for validation, {baseline} training "
            f"samples for the acceptance baseline) and the largest training sample ({largest:,}): give at "
            f"least {need:,} bytes, hold out fewer samples (--eval-fraction, --eval-max-samples) or --no-eval"
        )
    keep = set(always)
    kept = held
    if mode == "hybrid":
        reserve = max(largest, (budget - held) // WINDOW_SHARE)
        for i in sorted(set(train) - keep):
            if kept + sizes[i] + reserve > budget:
                break
            keep.add(i)
            kept += sizes[i]
    return StatesPlan(mode, budget, frozenset(keep), kept, budget - kept)


def epoch_batches(
    lengths: Sequence[int], max_len: int, seed: int, epoch: int, world_size: int = 1
) -> list[list[int]]:
    """The trainer's batches of one epoch as dataset indices, in the order they are read: speculators' own
    packing sampler with the arguments pipeline/train/data.py gives each of ``world_size`` data-parallel
    ranks, interleaved step by step (rank 0's first batch, rank 1's first, ..., rank 0's second, ...). Every
    rank takes the same number of steps (speculators packs one batch per rank at a time); a sampler that
    did not would leave the producer's schedule and the ranks' reads apart: refused."""
    ranks = [_rank_batches(lengths, max_len, seed, epoch, world_size, r) for r in range(world_size)]
    steps = {len(batches) for batches in ranks}
    if len(steps) != 1:
        raise StageError(
            f"speculators' sampler gave the {world_size} ranks {sorted(steps)} steps in epoch {epoch}, not "
            "one count: the producer cannot follow them (a speculators change); train in one process"
        )
    return [batch for step in zip(*ranks, strict=True) for batch in step]


def _rank_batches(
    lengths: Sequence[int], max_len: int, seed: int, epoch: int, world_size: int, rank: int
) -> list[list[int]]:
    """One rank's batches of one epoch, as its loader's sampler gives them."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=max_len, lengths=list(lengths), num_replicas=world_size, rank=rank, seed=seed
    )
    sampler.set_epoch(epoch)
    return [[int(i) for i in batch] for batch in sampler]


def production_order(
    epochs: Sequence[list[list[int]]],
    first_step: int,
    train: Sequence[int],
    held_out: Sequence[int],
    keep: frozenset[int],
    present: frozenset[int],
) -> list[int]:
    """Sample indices in the order the producer makes them: each epoch's batches (``epoch_batches``;
    ``epochs[0]`` from batch ``first_step``: a resumed epoch skips the steps its checkpoint holds,
    ``world_size`` merged batches per step) read through ``train`` (dataset index -> sample index), a kept
    sample only while it is neither on disk (``present``) nor produced earlier; the held-out samples not on
    disk after the first epoch's (the first validation reads them); last, any other kept sample still
    missing (one whose step a resumed run skips), so that the run ends with every kept file, as verify
    expects."""
    order: list[int] = []
    made = set(present)
    for e, batches in enumerate(epochs):
        for batch in batches[first_step if e == 0 else 0 :]:
            for j in batch:
                i = train[j]
                if i in keep and i in made:
                    continue
                order.append(i)
                made.add(i)
        if e == 0:
            order.extend(i for i in held_out if i not in made)
            made.update(held_out)
    if not epochs:
        order.extend(i for i in held_out if i not in made)
        made.update(held_out)
    order.extend(i for i in sorted(keep) if i not in made)
    return order


def next_chunk(
    order: Sequence[int],
    start: int,
    lengths: Sequence[int],
    sizes: Sequence[int],
    max_batch_tokens: int,
    max_batch_size: int,
    room: int,
) -> int:
    """How many samples from ``order[start:]`` go into the next forward: extract's rule (batch size x longest
    <= max_batch_tokens, at most max_batch_size), and their files' bound within ``room``; at least one. A
    sample that comes again (a transient one read in two epochs) starts the next forward: one file each."""
    n, longest, total, seen = 0, 0, 0, set()
    for i in order[start:]:
        longest2 = max(longest, int(lengths[i]))
        full = (n + 1) * longest2 > max_batch_tokens or n >= max_batch_size or total + sizes[i] > room
        if n and (full or i in seen):
            break
        n, longest, total = n + 1, longest2, total + sizes[i]
        seen.add(i)
    return n


# ---------------------------------------------------------------- the states dir


def is_states_dir(dc: formats.DataConfig) -> bool:
    """A states dir this module writes (not a finished extract set)."""
    return isinstance(dc.extra, dict) and isinstance(dc.extra.get("states"), dict)


def prepare_states_dir(
    directory: Path,
    expected: formats.DataConfig,
    plan: StatesPlan,
    prepared: formats.PreparedSamples,
    *,
    resume: bool,
    overwrite: bool,
    log=print,
) -> frozenset[int]:
    """Apply the --resume/--overwrite policy to the states dir; return the kept samples already on disk.

    A new run needs an empty or absent dir. --overwrite empties a states dir of this module only (never an
    extract's set). --resume keeps the kept files that are this run's (ids and mask against the prepared row,
    shapes and dtype: ``integrity.foreign_files``) and deletes every other state file: transient states of the
    killed run, kept files that are not this run's (produced again), partial files. Then data_config.json
    (with the plan) and sample_lengths.json are written, before any state."""
    from pipeline.ondisk import integrity
    from pipeline.extract.resume import VLLM_SCRATCH_GLOB, record_missing_checksums
    from pipeline.ondisk.atomic import remove_partials

    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise StageError(f"--data {directory} exists and is not a directory: choose another states dir")
    has_any = directory.is_dir() and any(directory.iterdir())
    found = None
    if (directory / formats.DATA_CONFIG).is_file():
        found = formats.read_data_config(directory)
        if not is_states_dir(found):
            raise StageError(
                f"--data {directory} holds a finished hidden-states set (pipeline extract): online and "
                "hybrid training write their own states dir; train on that set with --states-mode offline, "
                "or choose another --data"
            )
    if has_any and not (resume or overwrite):
        raise StageError(
            f"states dir {directory} is not empty: pass --resume to continue its run, --overwrite to replace "
            "it, or choose another --data"
        )
    if has_any and found is None:
        raise StageError(
            f"states dir {directory} has files but no data_config.json: not a states dir of online training; "
            "choose another --data"
        )
    if resume and found is not None:
        mismatch = formats.resume_mismatch(found, expected)
        if mismatch:
            raise StageError(
                f"cannot --resume with states dir {directory}: its data_config.json has {mismatch}; "
                "use --overwrite or another --data"
            )
    directory.mkdir(parents=True, exist_ok=True)
    for name in (FAILED, DONE, ALIVE):
        (directory / name).unlink(missing_ok=True)
    remove_partials(directory)
    for stale in directory.glob(VLLM_SCRATCH_GLOB):  # the vllm backend's files of a killed run
        shutil.rmtree(stale, ignore_errors=True)
    present = formats.existing_data_indices(directory)
    if overwrite and not resume:
        drop = present
    else:
        drop = [i for i in present if i not in plan.keep or i >= expected.num_samples]
    for i in drop:
        formats.data_file(directory, i).unlink(missing_ok=True)
    kept = sorted(set(present) - set(drop))
    if kept:
        foreign = integrity.foreign_files(directory, kept, expected, prepared)
        for i, reason in sorted(foreign.items()):
            log(f"states: data_{i}.pt will be produced again ({reason})")
            formats.data_file(directory, i).unlink(missing_ok=True)
        kept = [i for i in kept if i not in foreign]
    if drop and resume:
        log(f"states: removed {len(drop)} state files the plan does not keep (a killed run's transient ones)")
    formats.write_data_config(directory, expected)
    formats.write_sample_lengths(directory, {i: prepared.length(i) for i in range(expected.num_samples)})
    if kept:
        record_missing_checksums(directory, set(kept))
    return frozenset(kept)


def finish_states_dir(directory: Path, expected: formats.DataConfig) -> int:
    """After a run: the kept files' checksums folded into checksums.json, the journals removed, the data
    config's provenance stamped now; return the files on disk."""
    from pipeline.ondisk import provenance

    for name in (DONE, ALIVE):
        (Path(directory) / name).unlink(missing_ok=True)
    formats.fold_checksums(directory, set(range(expected.num_samples)))
    formats.write_data_config(directory, replace(expected, provenance=provenance.record("train-states")))
    return len(formats.existing_data_indices(directory))


def state_file_bytes(directory: Path) -> int:
    """Bytes of the state files in ``directory`` now: ``data_{i}.pt``, their partial writes and the vllm
    backend's per-request files where its scratch folder is there (what the budget bounds; the small json
    records are not counted)."""
    from pipeline.extract.resume import VLLM_SCRATCH_GLOB

    total = 0
    for p in Path(directory).iterdir():
        counted = formats.DATA_FILE_RE.match(p.name) or p.name.endswith(".partial")
        files = [p] if counted else list(p.rglob("*")) if p.match(VLLM_SCRATCH_GLOB) else []
        for f in files:
            try:
                total += f.stat().st_size if f.is_file() else 0
            except FileNotFoundError:
                pass
    return total


# ---------------------------------------------------------------- producer


@dataclass(frozen=True)
class Schedule:
    """What a producer makes: ``order``'s samples within ``plan``'s budget (``sizes``: each sample's bound on
    disk), the kept ones in ``present`` on disk already (``present_bytes``), in forwards of at most
    ``max_batch_tokens`` tokens and ``max_batch_size`` samples, each sample ``num_layers`` states of
    ``hidden_size``."""

    order: tuple[int, ...]
    plan: StatesPlan
    sizes: tuple[int, ...]
    present: frozenset[int]
    present_bytes: int
    hidden_size: int
    num_layers: int
    max_batch_tokens: int
    max_batch_size: int

    def record(self) -> dict:
        """The schedule as JSON (a producer in another process: pipeline/train/producer_process.py)."""
        record = {f: getattr(self, f) for f in self.__dataclass_fields__}
        plan = {f: getattr(self.plan, f) for f in self.plan.__dataclass_fields__}
        return {
            **record,
            "order": list(self.order),
            "sizes": list(self.sizes),
            "present": sorted(self.present),
            "plan": {**plan, "keep": sorted(self.plan.keep)},
        }

    @classmethod
    def from_record(cls, record: dict) -> Schedule:
        plan = StatesPlan(**{**record["plan"], "keep": frozenset(record["plan"]["keep"])})
        return cls(
            **{
                **record,
                "order": tuple(record["order"]),
                "sizes": tuple(record["sizes"]),
                "present": frozenset(record["present"]),
                "plan": plan,
            }
        )


@dataclass
class ProducerStats:
    samples: int = 0
    tokens: int = 0
    bytes_written: int = 0
    capture_seconds: float = 0.0
    room_wait_seconds: float = 0.0  # waiting for the trainer to use states: the producer was ahead
    peak_bytes: int = 0  # state files on disk at most, by the producer's ledger
    errors: list[str] = field(default_factory=list)


class Producer:
    """Produces ``order``'s samples with ``backend`` into ``directory`` on a background thread, the state
    files on disk (kept ones, ones waiting to be read, the one being written) never above ``plan.budget``.

    Kept samples' files stay and their checksums go to the extract journal; transient ones are deleted by
    their reader (``ProducedDataset``), which the producer sees by their absence."""

    def __init__(self, backend, directory: Path, prepared: formats.PreparedSamples, schedule: Schedule):
        self.backend, self.directory, self.prepared = backend, Path(directory), prepared
        self.order, self.plan, self.sizes = list(schedule.order), schedule.plan, schedule.sizes
        self.hidden_size, self.num_layers = schedule.hidden_size, schedule.num_layers
        self.max_batch_tokens, self.max_batch_size = schedule.max_batch_tokens, schedule.max_batch_size
        self.lengths = prepared.lengths()
        self.kept_bytes = schedule.present_bytes  # real sizes of the kept files on disk
        self.waiting: dict[int, int] = {}  # transient sample -> its file's size, until its reader deletes it
        self.stats = ProducerStats(peak_bytes=schedule.present_bytes)
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="states-producer", daemon=True)
        self.journal = formats.ChecksumJournal(self.directory)

    def start(self) -> Producer:
        clear_failure(self.directory)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop after the forward in progress (the trainer ended, or failed); the run's readers' flags are
        let go (a later run in this process registers its own)."""
        self._stop.set()
        self._thread.join()
        self.journal.close()
        _READER_FLAGS.pop(str(self.directory), None)

    @property
    def running(self) -> bool:
        """Still producing: neither done with its schedule, nor failed, nor stopped."""
        return self._thread.is_alive()

    def finish(self) -> int:
        """The trainer is done: stop, raise the producer's error, return the samples of the schedule it did
        not make (none when the schedule was the trainer's)."""
        self.stop()
        if self.error is not None:
            raise self.error
        return len(self.order) - self.stats.samples

    def _on_disk(self) -> int:
        for i in [i for i in self.waiting if not formats.data_file(self.directory, i).exists()]:
            del self.waiting[i]
        return self.kept_bytes + sum(self.waiting.values())

    def _wait_for_room(self, chunk: list[int]) -> bool:
        """Wait until ``chunk``'s files fit the budget and no sample of it still has a copy waiting to be read
        (a transient sample read in two epochs: written again, its file would replace the unread copy, and
        the first read would delete the copy meant for the later epoch: the trainer would wait for it
        forever). False when stopped."""
        need = sum(self.sizes[i] for i in chunk)
        t0 = time.perf_counter()
        while self._on_disk() + need > self.plan.budget or any(i in self.waiting for i in chunk):
            if self._stop.wait(WAIT_POLL_S):
                return False
        self.stats.room_wait_seconds += time.perf_counter() - t0
        return True

    def _run(self) -> None:
        try:
            # the hf backend's device: CUDA's current device is per thread, this one starts on cuda:0
            device = getattr(self.backend, "device", None)
            if device is not None and getattr(device, "type", None) == "cuda" and device.index is not None:
                import torch

                torch.cuda.set_device(device)  # plain "cuda": the thread's current device, cuda:0
            pos = 0
            while pos < len(self.order) and not self._stop.is_set():
                room = self.plan.budget - self.kept_bytes
                n = next_chunk(
                    self.order,
                    pos,
                    self.lengths,
                    self.sizes,
                    self.max_batch_tokens,
                    self.max_batch_size,
                    room,
                )
                chunk = self.order[pos : pos + n]
                if not self._wait_for_room(chunk):
                    return
                self._produce(chunk)
                pos += n
            if not self._stop.is_set():
                (self.directory / DONE).write_text("done\n")
        except BaseException as exc:  # noqa: BLE001 - re-raised by finish() on the trainer's thread
            if isinstance(exc, OSError):  # a full disk, a read-only dir: the operator's to fix, in one line
                exc = StageError(
                    f"writing states to {self.directory} failed: {exc.strerror or exc} "
                    "(free space or lower --states-budget, then re-run with --resume)"
                )
            self.error = exc
            mark_failed(self.directory, str(exc))

    def _produce(self, chunk: list[int]) -> None:
        import torch

        from pipeline.ondisk import integrity

        seqs = [self.prepared.ids(i).tolist() for i in chunk]
        t0 = time.perf_counter()
        states = self.backend.capture(seqs)
        self.stats.capture_seconds += time.perf_counter() - t0
        if len(states) != len(chunk) or any(len(s) != self.num_layers for s in states):
            raise StageError(
                f"backend {self.backend.name} returned {len(states)} samples for {len(chunk)}, "
                f"or not {self.num_layers} layers each"
            )
        for i, seq, sample_states in zip(chunk, seqs, states, strict=True):
            for h in sample_states:
                if tuple(h.shape) != (len(seq), self.hidden_size):
                    raise StageError(
                        f"sample {i}: backend returned a state of shape {tuple(h.shape)}, "
                        f"expected ({len(seq)}, {self.hidden_size})"
                    )
            ids = torch.as_tensor(seq, dtype=torch.int64)
            mask = torch.from_numpy(self.prepared.mask(i).astype("int64"))
            target = formats.data_file(self.directory, i)
            kept = i in self.plan.keep
            facts = integrity.written_facts(ids, sample_states, mask) if kept else None
            digest = formats.write_sample(target, ids, sample_states, mask)
            if digest.bytes > self.sizes[i]:
                raise StageError(
                    f"data_{i}.pt has {digest.bytes} bytes, more than the {self.sizes[i]} planned for it: "
                    "the file-size bound (pipeline/train/states.py FILE_OVERHEAD) is wrong"
                )
            if kept:
                self.journal.record(
                    target.name, replace(digest, mtime_ns=target.stat().st_mtime_ns, facts=facts)
                )
                self.kept_bytes += digest.bytes
            else:
                self.waiting[i] = digest.bytes
            self.stats.samples += 1
            self.stats.tokens += len(seq)
            self.stats.bytes_written += digest.bytes
            self.stats.peak_bytes = max(self.stats.peak_bytes, self.kept_bytes + sum(self.waiting.values()))


def clear_failure(directory: Path) -> None:
    """A new producer of ``directory`` starts: an earlier run's failure in this process is not its."""
    _FAILED_HERE.pop(str(directory), None)


def mark_failed(directory: Path, message: str) -> None:
    """The producer of ``directory`` failed with ``message``: every reader learns it, in this process (its
    recorded error, the flags of its loader workers) and in others (the FAILED file, where the disk lets it be
    written)."""
    _FAILED_HERE[str(directory)] = message
    for flag in _READER_FLAGS.get(str(directory), []):
        flag.value = 1
    try:
        (Path(directory) / FAILED).write_text(f"{message}\n")
    except OSError:  # a disk too full even for this line: readers in this process still see it
        pass


# ---------------------------------------------------------------- the trainer's side


def register_reader(directory: Path, flag) -> None:
    """A reader of ``directory`` in this process or a worker of it: ``flag`` (a shared value, e.g. a spawn
    context's ``RawValue("b")``) is set to 1 when the producer fails, which ``wait_for(..., failed=flag)``
    sees in any process."""
    _READER_FLAGS.setdefault(str(directory), []).append(flag)


def producer_failure(directory: Path) -> StageError | None:
    """The producer's failure as a reader reports it, if the producer of ``directory`` in this process
    failed: the run's error in one line (a loader worker's report of it carries its traceback)."""
    if str(directory) in _FAILED_HERE:
        return StageError(f"the states producer failed: {_FAILED_HERE[str(directory)]}")
    return None


def reported_failure(directory: Path) -> StageError | None:
    """The producer's failure as any rank of the run reports it: this process's producer's error, else the
    FAILED file rank 0's producer wrote (the other ranks of a torchrun job); None when it did not fail."""
    error = producer_failure(directory)
    failed = Path(directory) / FAILED
    if error is None and failed.is_file():
        error = StageError(f"the states producer failed: {failed.read_text().strip()}")
    return error


class Heartbeat:
    """Rank 0's process vouches for the run: a daemon thread sets the states dir's ALIVE file's mtime to now
    every ``period`` seconds, from when rank 0 has prepared the dir until the run ends (``with``; the file
    then stays, unmoving, and ``finish_states_dir`` or the next run's ``prepare_states_dir`` removes it). The
    file names the process (pid, start time, host, pid namespace), so that a reader beside it can ask whether
    it is gone.

    It is for the one death nothing else reports: torchrun's agent and rank 0 SIGKILLed together (an
    operator's ``kill -9`` of the job's pids, the OOM killer). The agent then cannot end the other ranks, and
    rank 0's producer (a thread in it) cannot mark the run failed, so a rank waiting for its next file would
    wait forever; with this file silent and its process gone it ends in one line (``wait_for``)."""

    def __init__(self, directory: Path, period: float = HEARTBEAT_S):
        self.path, self.period = Path(directory) / ALIVE, period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="states-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        import psutil

        me = psutil.Process()
        owner = {
            "pid": me.pid,
            "started": me.create_time(),
            "host": socket.gethostname(),
            "pids": _pid_space(),
        }
        self.path.write_text(json.dumps(owner) + "\n")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self.period):
            try:
                os.utime(self.path)  # never re-created: once finish_states_dir removed it, the run is over
            except OSError:  # gone, or a disk that refuses even this: the readers' other signals remain
                pass


def _pid_space() -> str | None:
    """This process's pid namespace (``pid:[N]``): a pid means the same process only within one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _process_gone(owner: dict) -> bool:
    """The process the heartbeat names is no longer there on this host: no such pid, a pid reused by a later
    process (another start time), or a zombie nobody reaped."""
    import psutil

    try:
        process = psutil.Process(int(owner["pid"]))
        return abs(process.create_time() - float(owner["started"])) > 1e-3 or (
            process.status() == psutil.STATUS_ZOMBIE
        )
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:  # there, someone else's: not gone
        return False


class _Pulse:
    """A reader's view of the heartbeat: how long ALIVE's mtime has not changed, on the reader's own monotonic
    clock (no comparison with the writer's clock, so a skewed or coarse file-system clock cannot fake a stop),
    and then whether its process is gone. An absent file says nothing: a run before this file existed, or
    rank 0 not yet there."""

    CHECK_S = 0.25  # a reader's wait polls every 1-50 ms; the heartbeat moves every HEARTBEAT_S

    def __init__(self, path: Path, stale_s: float, remote_s: float):
        self.path, self.stale_s, self.remote_s = path, stale_s, remote_s
        self.mtime: int | None = None
        self.since = time.monotonic()
        self.looked = -math.inf  # when the file was last looked at: at most every CHECK_S, not every poll
        self.owner: tuple[dict | None, bool] | None = None  # the record, and whether beside us

    def stopped(self) -> str | None:
        """Why rank 0 is gone, once its heartbeat has been silent ``stale_s`` and its process is gone (on
        this host, in this pid namespace), or silent ``remote_s`` (its process elsewhere, or not named); else
        None."""
        now = time.monotonic()
        if now - self.looked < self.CHECK_S:
            return None
        self.looked = now
        try:
            mtime = self.path.stat().st_mtime_ns
        except OSError:
            self.mtime = None
            return None
        if mtime != self.mtime:
            self.mtime, self.since, self.owner = mtime, now, None
            return None
        silent = now - self.since
        if silent < self.stale_s:
            return None
        if self.owner is None:
            self.owner = self._read_owner()
        owner, here = self.owner
        if here:
            if not _process_gone(owner):
                return None  # stopped (SIGSTOP), or too busy to beat: it may still write the file
            pid, folder = owner["pid"], self.path.parent
            return f"its process {pid} is gone; {ALIVE} in {folder} unmoved for {silent:.0f} s"
        if silent < self.remote_s:
            return None
        where = f" on host {owner['host']}" if owner else ""  # the host, or another pid namespace on this one
        return f"{ALIVE} in {self.path.parent} unmoved for {silent:.0f} s, rank 0{where} not asked"

    def _read_owner(self) -> tuple[dict | None, bool]:
        """The process the file names, and whether its pid can be asked from here: only from its host and
        pid namespace (another container's pids are another space)."""
        try:
            owner = json.loads(self.path.read_text())
            return owner, owner["host"] == socket.gethostname() and owner.get("pids") == _pid_space()
        except (OSError, ValueError, TypeError, KeyError):  # unreadable, or a file without the fields
            return None, False


def rank0_gone(directory: Path) -> bool:
    """The run failed because rank 0's process is gone (a reader's verdict on its silent heartbeat): no rank 0
    is left to report it or to end the job."""
    error = reported_failure(directory)
    return error is not None and str(error).startswith(f"the states producer failed: {ORPHANED}")


def wait_for(
    path: Path,
    directory: Path,
    timeout: float | None = None,
    failed_flag=None,
    stale_s: float | None = None,
) -> None:
    """Return once ``path`` exists; raise if the producer failed (``failed_flag`` set, its FAILED file, or
    its error recorded in this process), finished without it, or if rank 0's process is gone (its heartbeat
    silent for ``stale_s``, default ``STALE_S``, and no such process on its host; or silent
    ``STALE_REMOTE_S`` where it cannot be asked): then this reader marks the run failed for every other
    reader first."""
    t0 = time.monotonic()
    delay = WAIT_POLL_S / 5
    pulse = _Pulse(directory / ALIVE, STALE_S if stale_s is None else stale_s, STALE_REMOTE_S)
    while not path.exists():
        if (error := reported_failure(directory)) is not None:
            raise error
        if failed_flag is not None and failed_flag.value:
            raise StageError("the states producer failed (the training process reports why)")
        if (directory / DONE).exists() and not path.exists():
            raise StageError(f"{path.name} was read but the producer's schedule did not make it (a bug)")
        if (gone := pulse.stopped()) is not None and not path.exists():
            mark_failed(
                directory,
                f"{ORPHANED} ({gone}: killed together with torchrun's agent?) while this rank waited for "
                f"{path.name}; re-run with --resume",
            )
            raise reported_failure(directory)
        if timeout is not None and time.monotonic() - t0 > timeout:
            raise StageError(f"{path} did not appear within {timeout:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
