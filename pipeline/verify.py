"""The ``verify`` stage: a summary.json and a table for any stage's output, non-zero exit on a failed check.

Owns the checks of each output kind: prepared data (arrays, masks, token_freq, vocab mapping), hidden
states (count, contiguity, each file's sha256 against the one extract recorded, keys, shapes, dtypes,
NaN/Inf, lengths, equality with the prepared rows, layer order and scale against the set's own profile
(pipeline/layer_profile.py), with ``--model`` a spot re-computation of K files (pipeline/recompute.py), and
the alignment check: final norm + lm_head on the last captured layer must give the target's own next-token
argmax; of a states dir that online or hybrid training keeps, its kept files: pipeline/train/states.py),
verifier weights, and draft checkpoints (delegated to pipeline/checkpoint_checks.py).
It reads outputs; it never modifies them (summary.json aside).

Also extract's closing check by the writer's record (``closing_check="record"``): the value facts a writer
computes from the tensors it holds (``written_facts``, stored in the checksum record by
pipeline/ondisk/formats.py) go through the same judges as a file read back (``_form_findings``,
``_value_findings``, ``_identity_findings``), and each file is only stat'ed against its recorded size and
mtime; what that cannot see (bytes changed in place, layer order) is what the full read is for (docs/vllm.md,
"The closing check").
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import click
import numpy as np

from contract.shards import shard
from pipeline import layer_profile, recompute
from pipeline.ondisk import formats, readers
from pipeline.checks import CheckResult, Summary, check, fail, ok, render, warn
from pipeline.errors import CheckFailed, StageError, require_range
from pipeline.options import opt, options, validate
from pipeline.vocab import token_frequencies, vocab_mapping_problems

# torch only in annotations here: the functions that use it import it, so that a command that only parses its
# arguments (--help, check-args) never loads it (tests/pipeline/test_cli_imports.py)
if TYPE_CHECKING:
    import torch

SUMMARY = "summary.json"
KINDS = ("prepared", "hidden_states", "verifier", "checkpoint")


@dataclass(frozen=True)
class VerifyConfig:
    """Options of the verify stage (the command line is made from these fields: pipeline/options.py)."""

    path: Path = opt(argument=True)  # any stage's output directory
    # hidden states: compare input_ids with these rows (default: from data_config)
    prepared: Path | None = opt(None, help="Prepared dir to compare input_ids with.")
    verifier: Path | None = opt(None, help="Dir with verifier.safetensors (alignment check).")
    model: Path | None = opt(
        None,
        help="Target model dir: recompute --recompute-samples files through it, compare with its own argmax.",
    )
    recompute_samples: int = opt(
        recompute.DEFAULT_SAMPLES,
        low=0,
        click_range=True,
        help="With --model: K random files whose states are computed again and "
        "compared layer by layer (0 = none).",
    )
    # None: a fresh seed, reported in summary.json
    recompute_seed: int | None = opt(
        None, low=0, click_range=True, help="Seed choosing them (default: fresh, reported)."
    )
    # None: by the stored dtype (recompute.TOLERANCE)
    recompute_tolerance: float | None = opt(
        None,
        low=0,
        low_open=True,
        click_range=True,
        help="Largest relative error per layer (default 0.1 for bf16/fp16 states, 1e-3 for fp32).",
    )
    trust_remote_code: bool = opt(
        False, help="With --model: allow the model's own Python code (e.g. Kimi-K2.5)."
    )
    alignment_samples: int = opt(4, low=1, high=1 << 20, help="With --model: files checked for alignment.")
    min_agreement: float = opt(
        0.95, low=0.0, high=1.0, help="With --model: the argmax agreement each of those files needs."
    )
    # 0 = default_workers(), bounded by memory (_readers)
    workers: int = opt(
        0,
        low=0,
        click_range=True,
        help="Parallel file readers (0 = 8, fewer with fewer cores, or when their buffers "
        "would take over a quarter of the free memory).",
    )
    # hidden states written by several hosts: check only this host's shard
    world_size: int = opt(1, help="Check only one host's shard: i %% W == rank.", low=1, high=1 << 16)
    rank: int = opt(0, help="This host's rank in --world-size.")  # 0..world_size-1, checked in __post_init__
    write_summary: bool = opt(True, cli=False)  # write PATH/summary.json
    # extract's closing check: "record" (stat + the writer's record) | "full"; None: `pipeline verify` itself
    closing_check: str | None = opt(None, cli=False)

    def __post_init__(self) -> None:
        validate(self)
        require_range("--rank", self.rank, 0, self.world_size - 1)


def detect_kind(path: Path) -> str:
    if not path.is_dir():
        raise StageError(f"{path} is not a directory: pass a stage output directory to verify")
    if (path / formats.DATA_CONFIG).is_file() or formats.existing_data_indices(path):
        return "hidden_states"
    if formats.is_prepared_dir(path) or (path / "metadata.json").is_file():
        return "prepared"
    if (path / "verifier.safetensors").is_file():
        return "verifier"
    if (path / "config.json").is_file() and "speculators_config" in (path / "config.json").read_text():
        return "checkpoint"
    if (path / "draft" / "config.json").is_file():  # a train output dir: its draft/ is checked
        return "checkpoint"
    raise StageError(
        f"{path} is not a stage output "
        "(no data_config.json, metadata.json, verifier.safetensors or draft config.json)"
    )


# ---------------------------------------------------------------- prepared data


def verify_prepared(path: Path) -> Summary:
    s = Summary("prepared", str(path))
    try:
        samples, meta = formats.read_prepared(path)
    except StageError as exc:
        s.checks.append(fail("readable", str(exc)))
        return s
    s.checks.append(ok("readable", f"{len(samples)} samples, {int(samples.offsets[-1])} tokens"))
    lengths = samples.lengths()
    s.checks.append(
        check(
            "lengths",
            bool(lengths.min() >= 1 and lengths.max() <= meta.max_tokens),
            f"1..{int(lengths.max())} <= {meta.max_tokens}",
            f"lengths {int(lengths.min())}..{int(lengths.max())} outside 1..{meta.max_tokens}",
        )
    )
    s.checks.append(
        check(
            "token_ids",
            bool(samples.tokens.max() < meta.target_vocab_size and samples.tokens.min() >= 0),
            f"all < {meta.target_vocab_size}",
            f"ids up to {int(samples.tokens.max())} >= vocab {meta.target_vocab_size}",
        )
    )
    loss = int(samples.loss_mask.sum())
    s.checks.append(
        check(
            "loss_mask",
            loss > 0 and set(np.unique(samples.loss_mask).tolist()) <= {0, 1},
            f"{loss} assistant tokens ({loss / max(1, len(samples.tokens)):.1%})",
            "no assistant tokens, or values other than 0/1",
        )
    )
    freq_path = path / formats.TOKEN_FREQ
    if freq_path.is_file():
        freq = formats.read_token_freq(freq_path)
        s.checks.append(
            check(
                "token_freq",
                freq == token_frequencies(samples.tokens, samples.loss_mask),
                f"{len(freq)} distinct tokens",
                "token_freq.pt differs from counts over the loss mask",
            )
        )
    else:
        s.checks.append(fail("token_freq", "token_freq.pt missing"))
    if (path / formats.D2T).is_file() or (path / formats.T2D).is_file() or meta.draft_vocab_size:
        s.checks.append(_vocab_check(path, meta.draft_vocab_size, meta.target_vocab_size))
    s.stats = {
        "samples": len(samples),
        "tokens": int(samples.offsets[-1]),
        "loss_tokens": loss,
        "max_length": int(lengths.max()),
        "mean_length": round(float(lengths.mean()), 1),
    }
    return s


def _vocab_check(path: Path, draft_vocab: int | None, target_vocab: int | None) -> CheckResult:
    try:
        d2t, t2d = formats.read_vocab(path)
    except StageError as exc:
        return fail("vocab_mapping", str(exc))
    problems = vocab_mapping_problems(d2t, t2d, draft_vocab, target_vocab)
    return check("vocab_mapping", not problems, f"draft {len(d2t)} -> target {len(t2d)}", "; ".join(problems))


# ---------------------------------------------------------------- hidden states


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


def _check_file(
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
    (``_record_findings``)."""
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


# ---------------------------------------------------------- the writer's record (extract's closing check)

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


def _record_findings(directory: Path, i: int, ctx: SetContext) -> list[CheckResult]:
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


def _record_reference(indices: list[int], ctx: SetContext) -> layer_profile.Reference | None:
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
    mapped files stopped gaining past 2-4 (docs/benchmarks.md). Each reader keeps a buffer as large as the
    largest file it read (``file_bytes`` at most), so the readers' buffers are held to a quarter of the
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


def _readers(workers: int, dc: formats.DataConfig):
    """The reader count (``workers``, or the default bounded by the largest file a data config allows and
    the memory available) and a loader for them."""
    itemsize = {"bfloat16": 2, "float16": 2}.get(
        dc.dtype, 4
    )  # a dtype the file check will report counts as 4
    largest = dc.seq_length * dc.hidden_size * len(dc.layer_ids) * itemsize
    return workers or default_workers(largest, available_memory()), reader_loads()


@contextmanager
def _threads_per_reader(readers: int):
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
    workers, load = _readers(workers, dc)
    with _threads_per_reader(workers), ThreadPoolExecutor(max_workers=workers) as pool:
        ctx = set_context(directory, indices, dc, pool, load, prepared=prepared)
        results = list(pool.map(lambda i: (i, _check_file(directory, i, ctx, load)[0]), indices))
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
            pool.map(lambda i: (i, _check_file(directory, i, ctx, load, _ownership_findings)[0]), indices)
        )
    return {i: _reasons(cs) for i, cs in results if cs}


def _reasons(findings: list[CheckResult]) -> str:
    """The first finding of each check, in order: ``check: detail; ...``."""
    first: dict[str, CheckResult] = {}
    for c in findings:
        first.setdefault(c.name, c)
    return "; ".join(f"{c.name}: {c.detail}" for c in first.values())


def _rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The final norm as transformers' RMSNorm computes it (fp32 statistics, result in the states' dtype)."""
    import torch

    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(h.dtype) * x.to(h.dtype)


def alignment(directory: Path, indices: list[int], verifier: dict, target, eps: float) -> dict[int, dict]:
    """Per file: argmax of lm_head(norm(last captured)) vs the target's own argmax (``target``: the loaded
    causal LM, or None), and vs input_ids[t+1]."""
    import torch

    norm_w, head = verifier["norm.weight"], verifier["lm_head.weight"]
    result = {}
    for i in indices:
        d = formats.read_sample(directory / f"data_{i}.pt")
        last = d["hidden_states"][-1]
        logits = _rms_norm(last, norm_w, eps).to(torch.float32) @ head.to(torch.float32).T
        pred = logits.argmax(-1)
        ids = d["input_ids"]
        row = {"next_token_rate": float((pred[:-1] == ids[1:]).float().mean()) if len(ids) > 1 else math.nan}
        if target is not None:
            own = _target_argmax(target, ids)
            row["agreement"] = float((pred == own).float().mean())
        result[i] = row
    return result


def _open_target(cfg: VerifyConfig, dc: formats.DataConfig):
    """The target through the hf backend over the set's layer ids (fp32 on the CPU, the set's dtype on a
    GPU): what the spot re-computation runs and the alignment check takes the target's argmax from."""
    from pipeline.backends.base import BackendOptions, resolve_device
    from pipeline.backends.hf import HFBackend
    from pipeline.modeldir import check_checkpoint, read_model_dir

    model = read_model_dir(cfg.model)
    check_checkpoint(model)  # config vs checkpoint, as extract checks it: a model that is not what it claims
    dtype = dc.dtype if resolve_device("auto").type == "cuda" else "float32"
    return HFBackend(
        BackendOptions(
            model=model,
            layer_ids=tuple(dc.layer_ids),
            dtype=dtype,
            seq_length=dc.seq_length,
            trust_remote_code=cfg.trust_remote_code,
            **recompute_kernels((dc.extra if isinstance(dc.extra, dict) else {}).get("compute_path")),
        )
    )


def recompute_kernels(path: dict | None) -> dict:
    """The hf backend's kernel options for the spot re-computation: the extraction's own (data_config.json's
    ``extra.compute_path``) when the hf backend made the set, so that the comparison sees no rounding of
    another path (compiled, fused and plain bf16 paths were 10-11% apart at deep layers of a random 8B model
    on the H200, against the bf16 tolerance of 0.1); eager otherwise (a set of the vllm backend, or written
    before the path was recorded): a compile never pays for a few samples. On the CPU both are off anyway."""
    if isinstance(path, dict) and path.get("backend") == "hf":
        return {"compile": bool(path.get("compiled")), "fused_norms": bool(path.get("fused_norms"))}
    return {"compile": False, "fused_norms": None}


def _target_argmax(model, ids: torch.Tensor) -> torch.Tensor:
    import torch

    device = next(model.parameters()).device
    with torch.inference_mode():
        return model(input_ids=ids[None].to(device), use_cache=False).logits[0].argmax(-1).cpu()


def verify_hidden_states(cfg: VerifyConfig) -> Summary:
    """Every check of a hidden-states set; as extract's closing check (``cfg.closing_check``) its files are
    judged by the writer's record ("record", reading none of them back) or read in full ("full")."""
    path, t0 = cfg.path, time.perf_counter()
    s = Summary("hidden_states", str(path))
    try:
        dc = formats.read_data_config(path)
    except StageError as exc:
        s.checks.append(fail("data_config", str(exc)))
        return s
    s.checks.append(
        ok("data_config", f"{dc.num_samples} samples, layers {dc.layer_ids}, H={dc.hidden_size}, {dc.dtype}")
    )
    expected = set(shard(dc.num_samples, cfg.rank, cfg.world_size))
    if not expected:  # a shard that selects no file has nothing to be OK about
        s.checks.append(
            fail(
                "shard",
                f"--rank {cfg.rank} of --world-size {cfg.world_size} selects none of the "
                f"{dc.num_samples} samples: check --world-size",
            )
        )
        return s
    present = formats.existing_data_indices(path)
    kept = _kept_samples(dc)
    if kept is not None:  # a states dir of online/hybrid training: only its kept files are meant to stay
        expected &= kept
    extra = sorted(set(present) - (kept if kept is not None else set(range(dc.num_samples))))
    indices = sorted(set(present) & expected)
    missing = sorted(expected - set(indices))
    which = f" (shard {cfg.rank}/{cfg.world_size})" if cfg.world_size > 1 else ""
    if kept is not None:
        which += f", the {len(kept)} kept by {dc.extra['states'].get('mode')} training"
    s.checks.append(
        check(
            "contiguity",
            not missing and not extra,
            f"data_0..data_{dc.num_samples - 1}{which}",
            f"missing {_ranges(missing)}" + (f"; unexpected {_ranges(extra)}" if extra else ""),
        )
    )
    s.checks.append(
        check(
            "count",
            len(indices) == len(expected) and not extra,
            f"{len(indices)} files{which}",
            f"{len(indices)} data files{which}, "
            f"expected {len(expected)} of data_config.json's {dc.num_samples}",
        )
    )
    partials = [p.name for p in path.glob(".*.partial")]
    if partials:
        s.checks.append(warn("partials", f"{len(partials)} leftover partial files (removed by --resume)"))
    lengths = formats.read_sample_lengths(path)
    s.checks.append(
        check(
            "sample_lengths",
            bool(lengths) and len(lengths) == dc.num_samples,
            f"{len(lengths)} entries",
            "sample_lengths.json missing"
            if not lengths
            else f"{len(lengths)} entries for {dc.num_samples} samples",
        )
    )
    prepared_dir = cfg.prepared or (Path(dc.prepared) if dc.prepared and Path(dc.prepared).is_dir() else None)
    prepared = formats.read_prepared(prepared_dir)[0] if prepared_dir else None
    checked = sorted(set(indices) & set(range(dc.num_samples)))
    by_record, fallback = cfg.closing_check == "record", None
    if by_record:
        recorded = formats.read_checksums(path)
        if fallback := _record_gap(checked, recorded):
            by_record = False
    if by_record:
        ctx = SetContext(dc, lengths or {}, prepared, recorded)
        ctx = replace(ctx, reference=_record_reference(checked, ctx))
        per_file = [_record_findings(path, i, ctx) for i in checked]
        names = RECORD_CHECKS
    else:
        workers, load = _readers(cfg.workers, dc)
        with _threads_per_reader(workers), ThreadPoolExecutor(max_workers=workers) as pool:
            ctx = set_context(path, checked, dc, pool, load, lengths, prepared)
            per_file = [cs for cs, _ in pool.map(lambda i: _check_file(path, i, ctx, load), checked)]
        names = FULL_CHECKS
    findings = [c for cs in per_file for c in cs]
    if extra:  # a file past the end that holds another file's recorded bytes was renamed: say which
        s.checks.extend(_renamed(path, extra, ctx))
    s.checks.append(_checksums_summary(path, ctx, len(checked), hashed=not by_record))
    s.checks.extend(findings)
    failed_names = {c.name for c in findings}
    for n in names:
        if n == "prepared_match" and prepared is None:
            s.checks.append(warn(n, "no prepared dir found: input_ids not compared"))
        elif n == "checksum" and not ctx.recorded:
            continue  # said once by the checksums row
        elif n in ("layer_order", "layer_scale") and ctx.reference is None:
            s.checks.append(
                warn(
                    n,
                    f"fewer than {layer_profile.MIN_REFERENCE_FILES} intact files to build the "
                    "set's layer profile from: not checked",
                )
            )
        elif n not in failed_names:
            detail = f"all {len(per_file)} files"
            if n == "unchanged":
                detail += ": size and mtime as extract recorded them (not read back)"
            s.checks.append(ok(n if n != "sample_lengths" else "lengths_match", detail))
    s.stats = {
        "samples": dc.num_samples,
        "files": len(indices),
        "layer_ids": dc.layer_ids,
        "dtype": dc.dtype,
        "world_size": cfg.world_size,
        "rank": cfg.rank,
        "missing": missing,
        "tokens": sum(lengths.get(i, 0) for i in indices),
        "checksums_recorded": len(ctx.recorded),
    }
    if ctx.reference is not None:
        s.stats["layer_profile"] = {
            "files": ctx.reference.files,
            "median_rms": [round(math.exp(x), 6) for x in ctx.reference.log_rms],
        }
    if cfg.closing_check is not None:
        s.stats["closing_check"] = "record" if by_record else "full"
        s.stats["closing_check_note"] = (RECORD_NOTE if by_record else FULL_NOTE) + (
            f" ({fallback})" if fallback else ""
        )
        s.stats["closing_check_seconds"] = round(time.perf_counter() - t0, 3)
    if cfg.verifier or cfg.model:
        unreadable = {c.file for c in findings if c.file and c.name in STRUCTURAL}
        readable = [i for i in checked if f"data_{i}.pt" not in unreadable]
        s.checks.extend(_model_checks(cfg, dc, readable, s))
    return s


def _kept_samples(dc: formats.DataConfig) -> set[int] | None:
    """The samples a states dir of ``pipeline train --states-mode online|hybrid`` keeps (its data config's
    ``extra["states"]["kept"]``: pipeline/train/states.py); None for an extract's set, which keeps all."""
    states = dc.extra.get("states") if isinstance(dc.extra, dict) else None
    if not isinstance(states, dict) or not isinstance(states.get("kept"), list):
        return None
    return {int(i) for i in states["kept"]}


def _renamed(path: Path, extra: list[int], ctx: SetContext) -> list[CheckResult]:
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


def _record_gap(indices: list[int], recorded: dict[str, formats.FileDigest]) -> str | None:
    """Why the record check cannot judge these files (the full read must), or None: files without a
    version 2 record of their values (written before extract recorded them, or hashed on resume by an older
    extract)."""
    bare = [i for i in indices if not has_facts(recorded.get(f"data_{i}.pt"))]
    if not bare:
        return None
    return (
        f"read in full: {len(bare)} of {len(indices)} files, {_ranges(bare, 3)}, have no writer's record of "
        "their values (written before extract recorded them)"
    )


def _checksums_summary(path: Path, ctx: SetContext, files: int, hashed: bool = True) -> CheckResult:
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


def _model_checks(
    cfg: VerifyConfig, dc: formats.DataConfig, readable: list[int], s: Summary
) -> list[CheckResult]:
    """The spot re-computation of K readable files (with --model) and the alignment check (on readable files:
    one whose bytes or profile are off is still worth its agreement figure), with one model load."""
    target = None
    out: list[CheckResult] = []
    try:
        if cfg.model:
            try:
                target = _open_target(cfg, dc)
            except StageError as exc:
                hint = (
                    ""
                    if cfg.trust_remote_code
                    else " (pass --trust-remote-code if the model needs its own code)"
                )
                return [fail("recompute", f"cannot load --model: {exc}{hint}")]
        if target is not None and cfg.recompute_samples > 0:
            if not readable:
                out.append(fail("recompute", "no readable files to recompute"))
            else:
                seed = (
                    cfg.recompute_seed
                    if cfg.recompute_seed is not None
                    else int.from_bytes(os.urandom(4), "little")
                )
                picked = recompute.pick(readable, cfg.recompute_samples, seed)
                load = reader_loads()
                checks, errors = recompute.spot_recompute(
                    lambda p: load(p)[0],
                    cfg.path,
                    picked,
                    dc.layer_ids,
                    dc.dtype,
                    target,
                    cfg.recompute_tolerance,
                )
                out.extend(checks)
                s.stats["recompute"] = {"samples": len(picked), "seed": seed, "relative_errors": errors}
        out.extend(_alignment_checks(cfg, dc, readable, s, target.model if target is not None else None))
    finally:
        if target is not None:
            target.close()
    return out


def _alignment_checks(
    cfg: VerifyConfig, dc: formats.DataConfig, good: list[int], s: Summary, target
) -> list[CheckResult]:
    from pipeline.weights import load_verifier

    if not good:
        return [fail("alignment", "no intact files to check")]
    if cfg.verifier:
        verifier = load_verifier(cfg.verifier)
    else:  # no verifier dir: take the final norm and lm_head from the model itself
        from pipeline.modeldir import read_model_dir, resolve_names
        from pipeline.weights import read_tensors, weight_map

        md = read_model_dir(cfg.model)
        wmap = weight_map(cfg.model)
        names = resolve_names(sorted(wmap), md.tie_word_embeddings)
        t = read_tensors(cfg.model, wmap, sorted({names.norm, names.lm_head}))
        verifier = {"norm.weight": t[names.norm], "lm_head.weight": t[names.lm_head]}
    cfg_path = Path(dc.model) / "config.json"
    raw = readers.read_model_config(cfg_path) if cfg_path.is_file() else {}
    eps = float((raw.get("text_config") or raw).get("rms_norm_eps", 1e-6))
    step = max(1, len(good) // max(1, cfg.alignment_samples))
    picked = good[::step][: cfg.alignment_samples]
    rows = alignment(cfg.path, picked, verifier, target, eps)
    s.stats["alignment"] = {f"data_{i}.pt": r for i, r in rows.items()}
    out = []
    for i, r in rows.items():
        if "agreement" in r:
            out.append(
                check(
                    "alignment",
                    r["agreement"] >= cfg.min_agreement,
                    f"argmax agreement {r['agreement']:.3f}, next-token {r['next_token_rate']:.3f}",
                    f"argmax agreement {r['agreement']:.3f} < {cfg.min_agreement}: "
                    "states are not the last layer's pre-norm output",
                    f"data_{i}.pt",
                )
            )
        else:
            out.append(
                ok(
                    "next_token_rate",
                    f"{r['next_token_rate']:.3f} (no --model: target argmax not compared)",
                    f"data_{i}.pt",
                )
            )
    return out


def _ranges(values: list[int], limit: int = 6) -> str:
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


# ---------------------------------------------------------------- verifier weights


def verify_verifier(path: Path) -> Summary:
    import torch

    from pipeline.weights import KEYS, VERIFIER_META, load_verifier

    s = Summary("verifier", str(path))
    try:
        tensors = load_verifier(path)
    except Exception as exc:  # noqa: BLE001
        s.checks.append(fail("loadable", f"{type(exc).__name__}: {exc}"))
        return s
    s.checks.append(
        check(
            "keys",
            set(tensors) == set(KEYS),
            ", ".join(sorted(tensors)),
            f"keys {sorted(tensors)}, expected {list(KEYS)}",
        )
    )
    if set(tensors) != set(KEYS):
        return s
    e, n, h = tensors["embed_tokens.weight"], tensors["norm.weight"], tensors["lm_head.weight"]
    shapes_ok = e.ndim == 2 and h.shape == e.shape and tuple(n.shape) == (e.shape[1],)
    s.checks.append(
        check(
            "shapes",
            shapes_ok,
            f"embed {list(e.shape)}, norm {list(n.shape)}, lm_head {list(h.shape)}",
            f"embed {list(e.shape)}, norm {list(n.shape)}, lm_head {list(h.shape)} are inconsistent",
        )
    )
    bad = {k: int((~torch.isfinite(t)).sum()) for k, t in tensors.items()}
    s.checks.append(check("nan_inf", not any(bad.values()), "all finite", f"non-finite values: {bad}"))
    meta_path = path / VERIFIER_META
    if meta_path.is_file():
        meta = readers.read_json(meta_path, "run `pipeline weights --overwrite`")
        same = all(list(tensors[k].shape) == v for k, v in meta.get("shapes", {}).items())
        s.checks.append(
            check(
                "metadata", same, f"from {meta.get('source')}", "verifier.json shapes differ from the tensors"
            )
        )
        s.stats = {
            "source": meta.get("source"),
            "tied": meta.get("tied_word_embeddings"),
            "dtype": meta.get("dtype"),
        }
    else:
        s.checks.append(fail("metadata", "verifier.json missing"))
    return s


# ---------------------------------------------------------------- entry points


def verify(cfg: VerifyConfig) -> Summary:
    kind = detect_kind(cfg.path)
    try:
        if kind == "prepared":
            summary = verify_prepared(cfg.path)
        elif kind == "hidden_states":
            summary = verify_hidden_states(cfg)
        elif kind == "verifier":
            summary = verify_verifier(cfg.path)
        else:
            from pipeline.checkpoint_checks import verify_checkpoint

            summary = verify_checkpoint(cfg.path)
    except (
        StageError
    ) as exc:  # a damaged file read on the way (pipeline/ondisk/readers.py): a failed, named check
        summary = Summary(kind, str(cfg.path), [fail("readable", str(exc))])
    if cfg.write_summary:  # next to what was checked: a train dir's own summary.json is train's
        from pipeline.ondisk import provenance
        from pipeline.ondisk.atomic import write_json

        write_json(
            Path(summary.path) / SUMMARY,
            provenance.stamp(summary.to_json(), "verify", provenance.of_output(Path(summary.path))),
        )
    return summary


def report(cfg: VerifyConfig) -> Summary:
    """Verify, print the table, raise CheckFailed (one line) if any check failed."""
    summary = verify(cfg)
    render(summary)
    if not summary.ok:
        raise CheckFailed(summary.first_failure_line())
    return summary


@click.command("verify")
@options(VerifyConfig)
def command(**kwargs) -> None:
    """Check any stage's output; write PATH/summary.json; exit non-zero on a failed check."""
    report(VerifyConfig(**kwargs))
