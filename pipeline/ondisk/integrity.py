"""The integrity of a hidden-states set: the per-file and per-set checks that extract (its closing check,
resume, repair), online training's states (pipeline/train/states.py) and the verify stage all judge files by.

Per file (``check_file``): the sha256 against the one extract recorded, loadable, keys, input ids and mask,
layers, shapes and dtypes, NaN/Inf, lengths, equality with the prepared rows, layer order and scale against
the set's own profile (pipeline/model/layer_profile.py). Per set: which files are damaged (``damaged_files``)
or hold another file's bytes (``foreign_files``, ``renamed_findings``), the checksum index
(``checksums_summary``), and which samples a states dir keeps (``kept_samples``).

The record check (``closing_check="record"``): the value facts a writer computes from the tensors it holds
(``written_facts``, stored in the checksum record by pipeline/ondisk/formats.py) go through the same judges as
a file read back (``_form_findings``, ``_value_findings``, ``_identity_findings``), and each file is only
stat'ed against its recorded size and mtime; what that cannot see (bytes changed in place, layer order) is
what the full read is for (docs/vllm.md, "The closing check"). Reads files; never modifies them.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline.model import layer_profile
from pipeline.ondisk import formats
from pipeline.checks import CheckResult, fail, ok, warn

# torch only in annotations here: the functions that use it import it, so that a command that only parses its
# arguments (--help, check-args) never loads it (tests/pipeline/test_cli_imports.py)
if TYPE_CHECKING:
    import torch


def reader_loads():
    """A loader for reader threads: ``load(path)`` gives the sample and the file's digest. Each thread reads
    through its own ``SampleBuffer`` (the digest hashes the bytes it read) and falls back to
    ``formats.read_sample`` (read whole, not mapped: torch.load's mapped path accepts a storage record of
    another size than the pickle says, which its plain path, speculators' loader and train refuse; and
    hashed by a read of its own) for a file the buffer path does not take; the samples it returns are valid
    until the same thread loads the next file."""
    from pipeline.ondisk.sample_buffer import NotFastPath, SampleBuffer

    local = threading.local()

    def load(path: Path) -> tuple[dict, formats.FileDigest]:
        if not hasattr(local, "buffer"):
            local.buffer = SampleBuffer()
        try:
            return local.buffer.read(path), local.buffer.digest()
        except NotFastPath:
            return formats.read_sample(path, mmap=False), formats.file_digest(path)

    return load


#: the per-file checks of a full read, and of the record check (which reads no file: no checksum, no layer
#: order)
FULL_CHECKS = (
    "checksum",
    "loadable",
    "keys",
    "ids_mask",
    "layers",
    "shape_dtype",
    "nan_inf",
    "layer_order",
    "layer_scale",
    "length",
    "sample_lengths",
    "prepared_match",
)


RECORD_CHECKS = (
    "unchanged",
    "layers",
    "shape_dtype",
    "nan_inf",
    "layer_scale",
    "length",
    "sample_lengths",
    "prepared_match",
)


FULL_NOTE = "every byte read back and hashed"


RECORD_NOTE = (
    "judged by the writer's record: each file's size and mtime (one stat), its values as the writer "
    "saw them; no byte read back, layer order not judged: `pipeline verify` re-reads every byte"
)


#: per-file checks that say the file cannot be read as a sample at all (the others judge its content)
STRUCTURAL = ("loadable", "keys", "ids_mask", "layers", "shape_dtype", "nan_inf")


@dataclass(frozen=True)
class SetContext:
    """What each file is judged against: the set's config, lengths, prepared rows, recorded checksums and
    layer profile."""

    dc: formats.DataConfig
    lengths: dict[int, int] = field(default_factory=dict)
    prepared: object = None
    recorded: dict[str, formats.FileDigest] = field(default_factory=dict)
    reference: layer_profile.Reference | None = None

    def owner_of(self, sha256: str) -> str | None:
        """The file whose recorded checksum is ``sha256``."""
        return next((n for n, d in self.recorded.items() if d.sha256 == sha256), None)


def _checksum_finding(
    name: str, digest: formats.FileDigest | None, ctx: SetContext, damaged: bool
) -> CheckResult | None:
    """A failed ``checksum`` check naming how the file's bytes differ from what extract recorded, or None."""
    if not ctx.recorded or digest is None:
        return None
    want = ctx.recorded.get(name)
    if want is None:
        return fail(
            "checksum",
            "no checksum recorded for this file: not written by this set's extract "
            "(or its run was killed before recording it: run extract --resume, which records it)",
            name,
        )
    if digest.sha256 == want.sha256:
        return None
    twin = ctx.owner_of(digest.sha256)
    if twin is not None:
        return fail(
            "checksum",
            f"holds the bytes extract wrote as {twin}: files renamed or copied over each other",
            name,
        )
    if damaged and digest.bytes < want.bytes:
        return fail("checksum", f"truncated: {digest.bytes} bytes, extract wrote {want.bytes}", name)
    what = (
        "bytes differ from what extract wrote (damaged: see this file's other checks)"
        if damaged
        else "a well-formed sample whose bytes are not what extract wrote: "
        "a file from another set (or rewritten since)"
    )
    return fail(
        "checksum",
        f"{what}; {digest.bytes} bytes, sha256 {digest.sha256[:12]}, recorded {want.sha256[:12]}",
        name,
    )


def check_file(
    directory: Path, i: int, ctx: SetContext, load, judge=None
) -> tuple[list[CheckResult], list | None]:
    """The findings of one file, and its layer signatures (None where the file is not a readable sample).
    ``load(path)`` gives the sample and its digest (None: not hashed); ``judge`` its findings
    (default ``_sample_findings``, every per-file check)."""
    name = f"data_{i}.pt"
    try:
        d, digest = load(directory / name)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a finding
        try:
            digest = formats.file_digest(directory / name)
        except OSError:
            digest = None
        found = [
            fail(
                "loadable",
                f"cannot load: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                name,
            )
        ]
        return [c for c in [_checksum_finding(name, digest, ctx, True)] if c] + found, None
    out, stats = (judge or _sample_findings)(name, i, d, ctx)
    checksum = _checksum_finding(name, digest, ctx, any(c.name in STRUCTURAL for c in out))
    return ([checksum] if checksum else []) + out, stats


def _sample_findings(name: str, i: int, d, ctx: SetContext) -> tuple[list[CheckResult], list | None]:
    """Every per-file check of a loaded sample: its form, its values (NaN/Inf, layer order and scale, each
    state read whole), its identity; and its layer signatures."""
    out, t = _form_findings(name, d, ctx)
    if out:
        return out, None
    hs = d["hidden_states"]
    bad = [_nonfinite(h) for h in hs]
    stats = None if any(bad) else [layer_profile.layer_stats(h) for h in hs]
    return out + _value_findings(name, bad, stats, t, ctx) + _identity_findings(name, i, d, t, ctx), stats


def _value_findings(
    name: str, bad: list[int], stats: list | None, t: int, ctx: SetContext, order: bool = True
) -> list[CheckResult]:
    """The judges of a file's values, from its per-state non-finite counts and layer signatures (None where
    any state has a non-finite entry): NaN/Inf, and against the set's profile layer scale and (``order``)
    layer order. The same for a file read (``_sample_findings``) and for its writer's record
    (``record_findings``)."""
    dc, ref = ctx.dc, ctx.reference
    if any(bad):
        named = ", ".join(
            f"hidden_states[{j}] (layer {dc.layer_ids[j]}): {n}" for j, n in enumerate(bad) if n
        )
        return [fail("nan_inf", f"non-finite values: {named}", name)]
    out = []
    if ref is not None and stats is not None:
        if order and (problem := layer_profile.order_problem(stats, ref, t)):
            out.append(fail("layer_order", problem, name))
        if problem := layer_profile.scale_problem(stats, ref):
            out.append(fail("layer_scale", problem, name))
    return out


def _form_findings(name: str, d, ctx: SetContext) -> tuple[list[CheckResult], int]:
    """Whether a loaded file has a sample's form in this set: keys, ids/mask dtypes, layer count, each state's
    shape and dtype (tensor metadata only: no state is read unless the layer count is off); and its T."""
    import torch

    dc, ref = ctx.dc, ctx.reference
    if not isinstance(d, dict) or set(d) != set(formats.DATA_KEYS):
        return [
            fail(
                "keys",
                f"keys {sorted(d) if isinstance(d, dict) else type(d).__name__}, "
                f"expected {list(formats.DATA_KEYS)}",
                name,
            )
        ], -1
    ids, mask, hs = d["input_ids"], d["loss_mask"], d["hidden_states"]

    def form(x) -> str:  # what a value is, tensor or not (a damaged file's value may be anything)
        return f"{x.dtype}{tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"

    if not (isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor)):
        return [
            fail("ids_mask", f"input_ids {form(ids)}, loss_mask {form(mask)}; expected int64[T] both", name)
        ], -1
    t = int(ids.shape[0]) if ids.ndim == 1 else -1
    if ids.dtype != torch.int64 or ids.ndim != 1 or mask.dtype != torch.int64 or tuple(mask.shape) != (t,):
        return [
            fail(
                "ids_mask",
                f"input_ids {ids.dtype}{tuple(ids.shape)}, loss_mask {mask.dtype}{tuple(mask.shape)}; "
                "expected int64[T] both",
                name,
            )
        ], t
    if isinstance(hs, list) and not all(isinstance(h, torch.Tensor) for h in hs):
        j = next(j for j, h in enumerate(hs) if not isinstance(h, torch.Tensor))
        return [fail("shape_dtype", f"hidden_states[{j}] is {form(hs[j])}, expected a tensor", name)], t
    if not isinstance(hs, list) or len(hs) != len(dc.layer_ids):
        detail = (
            f"{len(hs) if isinstance(hs, list) else type(hs).__name__} hidden-state tensors, "
            f"expected {len(dc.layer_ids)}"
        )
        if (
            ref is not None
            and isinstance(hs, list)
            and 0 < len(hs) < len(dc.layer_ids)
            and all(tuple(h.shape) == (t, dc.hidden_size) for h in hs)
        ):
            detail += ": " + layer_profile.dropped_problem([layer_profile.layer_stats(h) for h in hs], ref)
        return [fail("layers", detail, name)], t
    want_dtype = getattr(torch, dc.dtype)
    return [
        fail(
            "shape_dtype",
            f"hidden_states[{j}] is {str(h.dtype).removeprefix('torch.')}{list(h.shape)}, "
            f"expected {dc.dtype}[{t}, {dc.hidden_size}]",
            name,
        )
        for j, h in enumerate(hs)
        if tuple(h.shape) != (t, dc.hidden_size) or h.dtype != want_dtype
    ], t


def _identity_findings(
    name: str, i: int, d: dict, t: int, ctx: SetContext, ids_mask_sha256: str | None = None
) -> list[CheckResult]:
    """Whether a sample of the right form is sample ``i`` of this set: its length, and its input_ids and
    loss_mask against the prepared row (only those two small tensors are read; or, given
    ``ids_mask_sha256``, the writer's digest of them, compared with the row's)."""
    dc, out = ctx.dc, []
    if t > dc.seq_length - 1 or t < 1:
        out.append(fail("length", f"T = {t} outside 1..seq_length-1 = {dc.seq_length - 1}", name))
    if ctx.lengths and ctx.lengths.get(i) != t:
        out.append(fail("sample_lengths", f"T = {t} but sample_lengths.json says {ctx.lengths.get(i)}", name))
    prepared = ctx.prepared
    if prepared is not None and i < len(prepared):
        if ids_mask_sha256 is not None:
            same = ids_mask_sha256 == ids_mask_digest(prepared.ids(i), prepared.mask(i))
        else:
            ids, mask = d["input_ids"], d["loss_mask"]
            same = np.array_equal(ids.numpy(), prepared.ids(i).astype(np.int64)) and np.array_equal(
                mask.numpy(), prepared.mask(i).astype(np.int64)
            )
        if not same:
            out.append(fail("prepared_match", f"input_ids/loss_mask differ from prepared row {i}", name))
    return out


def ids_mask_digest(ids, mask) -> str:
    """The sha256 of a sample's input_ids then loss_mask, both as int64 (what a data file holds)."""
    h = hashlib.sha256(np.ascontiguousarray(np.asarray(ids), dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(np.asarray(mask), dtype=np.int64).tobytes())
    return h.hexdigest()


FACTS_VERSION = 1  # of the ``facts`` of a checksum record (formats.py): what ``written_facts`` records


def written_facts(
    ids: torch.Tensor, states: list[torch.Tensor], mask: torch.Tensor, scales: list | None = None
) -> dict:
    """What the record check judges a data file by, computed by its writer from the tensors in hand before
    the write (no file is read): the tokens and each state's dtype and shape, each state's non-finite count
    (``_nonfinite``), each state's log RMS (``_log_rms``: layer_stats's figure; None for an all-zero state,
    and the list None where any state is non-finite, as verify keeps no signature then), and the digest of
    the ids and mask (``ids_mask_digest``). Layer order needs each state's mean vector, which is not kept.

    ``scales``: per state, its ``layer_profile.token_scales`` computed where the state was made (the GPU,
    before the copy to the host): the same figures then cost the writer a median of T floats instead of two
    passes over the state (on the CPU ~13 us per token per thread for a 1B model's four bf16 states)."""
    if scales is None:
        bad = [_nonfinite(h) for h in states]
        log_rms = None if any(bad) else [_log_rms(h) for h in states]
    else:
        bad = [int(count.sum()) for _, count in scales]
        log_rms = None if any(bad) else [_log_median(rms) for rms, _ in scales]
    return {
        "version": FACTS_VERSION,
        "tokens": int(ids.shape[0]),
        "states": [[str(h.dtype).removeprefix("torch."), *map(int, h.shape)] for h in states],
        "nonfinite": bad,
        "log_rms": log_rms,
        "ids_mask_sha256": ids_mask_digest(ids.numpy(), mask.numpy()),
    }


def _log_rms(h: torch.Tensor) -> float | None:
    """``layer_profile.layer_stats(h).log_rms`` without the mean over tokens that only the order judge needs
    (the mean cost the writer twice the norm's time on the CPU); None for an all-zero state. The test
    ``test_facts_of_written_tensors_match_what_a_read_finds`` holds the two figures equal."""
    return _log_median(layer_profile.token_rms(h))


def _log_median(rms: torch.Tensor) -> float | None:
    """The log of the median per-token RMS; None when it is zero (or there are no tokens)."""
    med = float(rms.median()) if rms.numel() else 0.0
    return math.log(med) if med > 0 else None


def has_facts(digest: formats.FileDigest | None) -> bool:
    """Whether a record carries what the record check needs (a version 2 entry with facts it knows)."""
    return (
        digest is not None
        and digest.mtime_ns is not None
        and isinstance(digest.facts, dict)
        and digest.facts.get("version") == FACTS_VERSION
    )


def _record_signatures(facts: dict) -> list | None:
    """A record's layer signatures (scale only: no mean vector), None where a state was non-finite."""
    import torch

    if facts["log_rms"] is None:
        return None
    no_mean = torch.zeros(1)  # a record keeps no state's mean vector: its signatures judge scale, not order
    return [layer_profile.LayerStats(-math.inf if x is None else float(x), no_mean) for x in facts["log_rms"]]


def _stand_in(facts: dict) -> dict:
    """A sample of the recorded form whose tensors hold no data (meta tensors): what ``_form_findings``
    judges, as it reads only keys, dtypes and shapes."""
    import torch

    t = int(facts["tokens"])
    states = [
        torch.empty(tuple(int(n) for n in shape), dtype=getattr(torch, dtype), device="meta")
        for dtype, *shape in facts["states"]
    ]
    return {
        "input_ids": torch.empty((t,), dtype=torch.int64, device="meta"),
        "hidden_states": states,
        "loss_mask": torch.empty((t,), dtype=torch.int64, device="meta"),
    }


def record_findings(directory: Path, i: int, ctx: SetContext) -> list[CheckResult]:
    """The findings of one file by its writer's record, reading none of its bytes: the file as recorded
    (its size and mtime, by one stat), then the recorded facts through the judges a read file goes through."""
    name = f"data_{i}.pt"
    rec = ctx.recorded[name]
    try:
        st = (directory / name).stat()
    except OSError as exc:
        return [fail("unchanged", f"cannot stat: {exc.strerror or exc}", name)]
    if st.st_size != rec.bytes:
        how = "truncated" if st.st_size < rec.bytes else "grown"
        return [
            fail(
                "unchanged",
                f"{how} since extract wrote it: {st.st_size} bytes, extract wrote {rec.bytes}",
                name,
            )
        ]
    if st.st_mtime_ns != rec.mtime_ns:
        return [
            fail(
                "unchanged",
                "modified since extract wrote it (its mtime is not the recorded one): replaced or rewritten",
                name,
            )
        ]
    try:
        d, stats, bad, digest = _read_facts(rec.facts)
    except _BAD_FACTS as exc:
        return [
            fail(
                "record",
                f"its record entry is not one extract writes ({type(exc).__name__}): run `pipeline verify`",
                name,
            )
        ]
    out, t = _form_findings(
        name, d, replace(ctx, reference=None)
    )  # no profile: a dropped layer's detail reads values
    if out:
        return out
    return _value_findings(name, bad, stats, t, ctx, order=False) + _identity_findings(
        name, i, d, t, ctx, digest
    )


_BAD_FACTS = (
    KeyError,
    TypeError,
    ValueError,
    AttributeError,
    RuntimeError,
)  # a record entry damaged or not ours


def _read_facts(facts: dict) -> tuple[dict, list | None, list[int], str]:
    """A record's stand-in sample, layer signatures, non-finite counts and ids+mask digest (``_BAD_FACTS``
    for an entry that does not have them)."""
    return (
        _stand_in(facts),
        _record_signatures(facts),
        [int(n) for n in facts["nonfinite"]],
        str(facts["ids_mask_sha256"]),
    )


def record_reference(indices: list[int], ctx: SetContext) -> layer_profile.Reference | None:
    """The set's profile from the records of the files ``set_context`` would read for it (scale only; an
    entry that cannot be read is left out, and named by its own file's check)."""
    sigs = []
    for i in _profile_picks(indices):
        try:
            sigs.append(_read_facts(ctx.recorded[f"data_{i}.pt"].facts)[1])
        except _BAD_FACTS:
            continue
    return layer_profile.build_reference([s for s in sigs if s is not None], ctx.dc.layer_ids)


def _ownership_findings(name: str, i: int, d, ctx: SetContext) -> tuple[list[CheckResult], None]:
    """The checks that need no state's values: whether the file is sample ``i`` of this run's form."""
    out, t = _form_findings(name, d, ctx)
    return out or _identity_findings(name, i, d, t, ctx), None


def _nonfinite(h: torch.Tensor) -> int:
    """How many entries of ``h`` are NaN or +-Inf. The minimum and maximum are both finite exactly when
    every entry is (NaN propagates through both), they cannot overflow, and one ``aminmax`` pass reads bf16
    at ~15 GB/s per core where ``isfinite`` manages ~0.5 and a float32 sum ~1.2 (measured on the CPU);
    only a tensor that has a non-finite entry pays the exact count."""
    import torch

    lo, hi = torch.aminmax(h)
    if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
        return 0
    return int((~torch.isfinite(h)).sum())


def default_workers(file_bytes: int = 0, available_bytes: int | None = None) -> int:
    """Parallel file readers: 8 (fewer on smaller machines), each with its share of the cores for torch's
    threads. On a 32-core H200 host the buffer path read 14.6 / 21.0 GB/s from tmpfs with 4 / 8 readers;
    mapped files stopped gaining past 2-4 (docs/benchmarks-history.md). Each reader keeps a buffer as large as
    the largest file it read (``file_bytes`` at most), so the readers' buffers are held to a quarter of the
    ``available_bytes`` of memory: a host short of memory reads with fewer threads rather than swapping
    or meeting the OOM killer (470 MB files, seq 8192 x hidden 7168, hold ~3.8 GB with 8 readers)."""
    readers = max(1, min(8, os.cpu_count() or 1))
    if file_bytes > 0 and available_bytes is not None:
        readers = max(1, min(readers, available_bytes // 4 // file_bytes))
    return readers


def available_memory() -> int | None:
    """Bytes of memory the kernel could give without swapping (MemAvailable), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def reader_pool(workers: int, dc: formats.DataConfig):
    """The reader count (``workers``, or the default bounded by the largest file a data config allows and
    the memory available) and a loader for them."""
    itemsize = {"bfloat16": 2, "float16": 2}.get(
        dc.dtype, 4
    )  # a dtype the file check will report counts as 4
    largest = dc.seq_length * dc.hidden_size * len(dc.layer_ids) * itemsize
    return workers or default_workers(largest, available_memory()), reader_loads()


@contextmanager
def threads_per_reader(readers: int):
    """Give each file reader its share of the cores for torch's own (intra-op) threads: N readers each
    running a pool of every core oversubscribe the machine (measured: 16 readers were slower than 4)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // readers))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def set_context(
    directory: Path,
    indices: list[int],
    dc: formats.DataConfig,
    pool,
    load,
    lengths=None,
    prepared=None,
    sample: int = 16,
) -> SetContext:
    """The context files are judged in: recorded checksums, and the layer profile of up to ``sample`` of
    ``indices`` spread over the set (their files read once more for it)."""
    picked = _profile_picks(indices, sample)

    def signature(i: int):
        try:
            d, _ = load(directory / f"data_{i}.pt")
            _, stats = _sample_findings(f"data_{i}.pt", i, d, SetContext(dc))
            return stats
        except Exception:  # noqa: BLE001 - an unreadable file is left out of the profile (and reported later)
            return None

    sigs = [s for s in pool.map(signature, picked) if s is not None]
    return SetContext(
        dc,
        lengths or {},
        prepared,
        formats.read_checksums(directory),
        layer_profile.build_reference(sigs, dc.layer_ids),
    )


def _profile_picks(indices: list[int], sample: int = 16) -> list[int]:
    """Up to ``sample`` of ``indices``, spread over the set: the files the set's layer profile is built
    from."""
    step = max(1, len(indices) // sample)
    return indices[::step][:sample]


def damaged_files(
    directory: Path, indices: list[int], dc: formats.DataConfig, prepared, workers: int = 0
) -> dict[int, str]:
    """Files among ``indices`` that fail any per-file check, with the first reason: what --repair redoes."""
    workers, load = reader_pool(workers, dc)
    with threads_per_reader(workers), ThreadPoolExecutor(max_workers=workers) as pool:
        ctx = set_context(directory, indices, dc, pool, load, prepared=prepared)
        results = list(pool.map(lambda i: (i, check_file(directory, i, ctx, load)[0]), indices))
    return {i: f"{cs[0].name}: {cs[0].detail}" for i, cs in results if cs}


def foreign_files(
    directory: Path, indices: list[int], dc: formats.DataConfig, prepared, workers: int = 0
) -> dict[int, str]:
    """Files among ``indices`` that are not this run's sample i, with their reasons: what ``extract --resume``
    refuses to skip. Cheap, unlike ``damaged_files``: each file is mapped, not read (its zip directory and
    pickle, then input_ids and loss_mask, compared with prepared row i; the states' count, shapes and dtypes
    come from the pickle), and stat'ed; only a file whose size differs from the one the set's checksum
    index records, or that was modified after the newest checksum record, is hashed and compared with it.
    Not seen: a file of the right form and tokens, copied in with its old mtime kept, holding other states
    (``--repair`` reads every byte)."""
    recorded = formats.read_checksums(directory)
    records = [*directory.glob(formats.CHECKSUM_INDEX_GLOB), *directory.glob(formats.CHECKSUM_JOURNAL_GLOB)]
    recorded_at = max((p.stat().st_mtime_ns for p in records), default=0)
    ctx = SetContext(dc, {}, prepared, recorded)

    def load(path: Path) -> tuple[dict, formats.FileDigest | None]:
        d = formats.read_sample(path, mmap=True)
        st, want = path.stat(), recorded.get(path.name)
        changed = want is not None and (st.st_size != want.bytes or st.st_mtime_ns > recorded_at)
        return d, formats.file_digest(path) if changed else None

    with ThreadPoolExecutor(max_workers=workers or default_workers()) as pool:
        results = list(
            pool.map(lambda i: (i, check_file(directory, i, ctx, load, _ownership_findings)[0]), indices)
        )
    return {i: _reasons(cs) for i, cs in results if cs}


def _reasons(findings: list[CheckResult]) -> str:
    """The first finding of each check, in order: ``check: detail; ...``."""
    first: dict[str, CheckResult] = {}
    for c in findings:
        first.setdefault(c.name, c)
    return "; ".join(f"{c.name}: {c.detail}" for c in first.values())


def kept_samples(dc: formats.DataConfig) -> set[int] | None:
    """The samples a states dir of ``pipeline train --states-mode online|hybrid`` keeps (its data config's
    ``extra["states"]["kept"]``: pipeline/train/states.py); None for an extract's set, which keeps all."""
    states = dc.extra.get("states") if isinstance(dc.extra, dict) else None
    if not isinstance(states, dict) or not isinstance(states.get("kept"), list):
        return None
    return {int(i) for i in states["kept"]}


def renamed_findings(path: Path, extra: list[int], ctx: SetContext) -> list[CheckResult]:
    out = []
    for i in extra[:64]:
        try:
            owner = ctx.owner_of(formats.file_digest(formats.data_file(path, i)).sha256)
        except OSError:
            continue
        if owner is not None:
            out.append(
                fail(
                    "renumbered",
                    f"holds the bytes extract wrote as {owner}: renamed out of its place",
                    f"data_{i}.pt",
                )
            )
    return out


def record_gap(indices: list[int], recorded: dict[str, formats.FileDigest]) -> str | None:
    """Why the record check cannot judge these files (the full read must), or None: files without a
    version 2 record of their values (written before extract recorded them, or hashed on resume by an older
    extract)."""
    bare = [i for i in indices if not has_facts(recorded.get(f"data_{i}.pt"))]
    if not bare:
        return None
    return (
        f"read in full: {len(bare)} of {len(indices)} files, {ranges(bare, 3)}, have no writer's record of "
        "their values (written before extract recorded them)"
    )


def checksums_summary(path: Path, ctx: SetContext, files: int, hashed: bool = True) -> CheckResult:
    damaged = [
        p.name
        for p in sorted(path.glob(formats.CHECKSUM_INDEX_GLOB))
        if not formats.read_checksum_index(p)
        and p.stat().st_size > 0
        and formats.CHECKSUM_SCHEMA not in p.read_text(errors="replace")[:200]
    ]
    if damaged:
        return fail(
            "checksums",
            f"{', '.join(damaged)} is not a checksum index (damaged): "
            "re-run extract --resume to record the files' checksums again",
        )
    if not ctx.recorded:
        return warn(
            "checksums",
            "no checksums recorded (a set written before extract recorded them): "
            "file contents not compared with what was written",
        )
    if not hashed:
        return ok(
            "checksums",
            f"{len(ctx.recorded)} recorded (sha256 of the bytes as written), {files} files judged by "
            "their record: not read back",
        )
    return ok("checksums", f"{len(ctx.recorded)} recorded (sha256), {files} files hashed")


def ranges(values: list[int], limit: int = 6) -> str:
    if not values:
        return "none"
    spans, start, prev = [], values[0], values[0]
    for v in values[1:]:
        if v != prev + 1:
            spans.append((start, prev))
            start = v
        prev = v
    spans.append((start, prev))
    text = ", ".join(f"data_{a}" if a == b else f"data_{a}..{b}" for a, b in spans[:limit])
    return text + (f" (+{len(spans) - limit} more ranges)" if len(spans) > limit else "")
