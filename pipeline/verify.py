"""The ``verify`` stage: a summary.json and a table for any stage's output, non-zero exit on a failed check.

Owns the checks of each output kind: prepared data (arrays, masks, token_freq, vocab mapping), hidden states
(count, contiguity, each file's sha256 against the one extract recorded, keys, shapes, dtypes, NaN/Inf,
lengths, equality with the prepared rows, layer order and scale against the set's own profile
(pipeline/model/layer_profile.py), with ``--model`` a spot re-computation of K files
(pipeline/model/recompute.py), and the alignment check: final norm + lm_head on the last captured layer must
give the target's own next-token argmax; of a states dir that online or hybrid training keeps, its kept files:
pipeline/train/states.py), verifier weights, and draft checkpoints (delegated to
pipeline/train/checkpoint_checks.py).
It reads outputs; it never modifies them (summary.json aside). The per-file and per-set checks of a states
set, which extract's closing check, resume and repair use too, are pipeline/ondisk/integrity.py's; this
module runs them over a set and adds what needs the model (alignment, recompute).
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import click
import numpy as np

from contract.shards import shard
from pipeline.model import layer_profile, recompute
from pipeline.ondisk import formats, readers
from pipeline.ondisk.integrity import (
    FULL_CHECKS,
    FULL_NOTE,
    RECORD_CHECKS,
    RECORD_NOTE,
    STRUCTURAL,
    SetContext,
    check_file,
    checksums_summary,
    kept_samples,
    ranges,
    reader_loads,
    reader_pool,
    record_findings,
    record_gap,
    record_reference,
    renamed_findings,
    set_context,
    threads_per_reader,
)
from pipeline.checks import CheckResult, Summary, check, fail, ok, render, warn
from pipeline.errors import CheckFailed, StageError, require_range
from pipeline.options import opt, options, validate
from pipeline.model.vocab import token_frequencies, vocab_mapping_problems

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
    # 0 = default_workers(), bounded by memory (reader_pool)
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


# ---------------------------------------------------------- the writer's record (extract's closing check)


def _rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The final norm as transformers' RMSNorm computes it (fp32 statistics, result in the states' dtype)."""
    import torch

    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(h.dtype) * x.to(h.dtype)


def alignment(
    directory: Path, indices: list[int], verifier: dict, target, eps: float, min_agreement: float = 0.0
) -> dict[int, dict]:
    """Per file: argmax of lm_head(norm(last captured)) vs the target's own argmax (``target``: the loaded
    causal LM, or None), and vs input_ids[t+1]. Where the agreement is under ``min_agreement``, also the
    target's agreement with itself when the sample is computed beside another (``self_agreement``): near-tied
    logits (a random target's) flip with the batch, and no stored set can agree better than that."""
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
            if row["agreement"] < min_agreement:
                row["self_agreement"] = float(
                    (_target_argmax(target, ids, beside=True) == own).float().mean()
                )
        result[i] = row
    return result


def _agreement_cause(self_agreement: float | None, needed: float) -> str:
    """Why a file's argmax agreement is low: the states (the target agrees with itself), or the target's own
    near-tied logits (it does not, computed beside another sample)."""
    if self_agreement is None or self_agreement >= needed:
        return "states are not the last layer's pre-norm output"
    return (
        f"the target itself agrees with its own argmax on only {self_agreement:.3f} of tokens when computed "
        "beside another sample (near-tied logits): this target's alignment cannot be confirmed "
        "(docs/reliability.md)"
    )


def _open_target(cfg: VerifyConfig, dc: formats.DataConfig):
    """The target through the hf backend over the set's layer ids (fp32 on the CPU, the set's dtype on a
    GPU): what the spot re-computation runs and the alignment check takes the target's argmax from."""
    from pipeline.backends.base import BackendOptions, resolve_device
    from pipeline.backends.hf import HFBackend
    from pipeline.model.modeldir import check_checkpoint, read_model_dir

    from pipeline.model.quantization import hf_refusal, read_quantization

    model = read_model_dir(cfg.model)
    check_checkpoint(model)  # config vs checkpoint, as extract checks it: a model that is not what it claims
    if refusal := hf_refusal(read_quantization(model.raw)):
        raise StageError(refusal)
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
        return {
            "compile": bool(path.get("compiled")),
            "fused_norms": bool(path.get("fused_norms")),
            # auto where they ran: fused wherever vLLM's kernel runs (in the image, on a GPU), never a refusal
            "fused_experts": None if path.get("fused_experts") else False,
        }
    return {"compile": False, "fused_norms": None, "fused_experts": None}


def _target_argmax(model, ids: torch.Tensor, beside: bool = False) -> torch.Tensor:
    """The target's argmax per position of ``ids``, computed alone or ``beside`` other rows
    (``recompute.probe_batch``, right-padded: under causal attention the full row never sees the padding).
    Only the sample's own row reaches the output head, so the logits stay one row's size."""
    import torch

    device = next(model.parameters()).device
    batch = ids[None]
    hook = None
    if beside:
        rows = [torch.tensor(row, dtype=ids.dtype) for row in recompute.probe_batch(ids.tolist())]
        batch = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # right-padded with 0
        if (head := model.get_output_embeddings()) is not None:  # else every row's logits: more memory
            hook = head.register_forward_pre_hook(lambda _, args: (args[0][:1], *args[1:]))
    try:
        with torch.inference_mode():
            return model(input_ids=batch.to(device), use_cache=False).logits[0].argmax(-1).cpu()
    finally:
        if hook is not None:
            hook.remove()


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
    kept = kept_samples(dc)
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
            f"missing {ranges(missing)}" + (f"; unexpected {ranges(extra)}" if extra else ""),
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
        if fallback := record_gap(checked, recorded):
            by_record = False
    if by_record:
        ctx = SetContext(dc, lengths or {}, prepared, recorded)
        ctx = replace(ctx, reference=record_reference(checked, ctx))
        per_file = [record_findings(path, i, ctx) for i in checked]
        names = RECORD_CHECKS
    else:
        workers, load = reader_pool(cfg.workers, dc)
        with threads_per_reader(workers), ThreadPoolExecutor(max_workers=workers) as pool:
            ctx = set_context(path, checked, dc, pool, load, lengths, prepared)
            per_file = [cs for cs, _ in pool.map(lambda i: check_file(path, i, ctx, load), checked)]
        names = FULL_CHECKS
    findings = [c for cs in per_file for c in cs]
    if extra:  # a file past the end that holds another file's recorded bytes was renamed: say which
        s.checks.extend(renamed_findings(path, extra, ctx))
    s.checks.append(checksums_summary(path, ctx, len(checked), hashed=not by_record))
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
                checks, errors, moved = recompute.spot_recompute(
                    lambda p: load(p)[0],
                    cfg.path,
                    picked,
                    dc.layer_ids,
                    dc.dtype,
                    target,
                    cfg.recompute_tolerance,
                )
                out.extend(checks)
                s.stats["recompute"] = {
                    "samples": len(picked),
                    "seed": seed,
                    "relative_errors": errors,
                    # failed files only: the target against itself, beside another sample
                    "self_difference": moved,
                }
        out.extend(_alignment_checks(cfg, dc, readable, s, target.model if target is not None else None))
    finally:
        if target is not None:
            target.close()
    return out


def _alignment_checks(
    cfg: VerifyConfig, dc: formats.DataConfig, good: list[int], s: Summary, target
) -> list[CheckResult]:
    if not good:
        return [fail("alignment", "no intact files to check")]
    if cfg.verifier:
        verifier = formats.load_verifier(cfg.verifier)
    else:  # no verifier dir: take the final norm and lm_head from the model itself
        from pipeline.model.modeldir import read_model_dir, resolve_names
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
    rows = alignment(cfg.path, picked, verifier, target, eps, cfg.min_agreement)
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
                    + _agreement_cause(r.get("self_agreement"), cfg.min_agreement),
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


# ---------------------------------------------------------------- verifier weights


def verify_verifier(path: Path) -> Summary:
    import torch

    s = Summary("verifier", str(path))
    try:
        tensors = formats.load_verifier(path)
    except Exception as exc:  # noqa: BLE001
        s.checks.append(fail("loadable", f"{type(exc).__name__}: {exc}"))
        return s
    s.checks.append(
        check(
            "keys",
            set(tensors) == set(formats.VERIFIER_KEYS),
            ", ".join(sorted(tensors)),
            f"keys {sorted(tensors)}, expected {list(formats.VERIFIER_KEYS)}",
        )
    )
    if set(tensors) != set(formats.VERIFIER_KEYS):
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
    meta_path = path / formats.VERIFIER_META
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
            from pipeline.train.checkpoint_checks import verify_checkpoint

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
    if summary.kind == "checkpoint":  # whole is not the same as worth serving: the gate that says so
        click.echo(
            f"whether it is worth serving: pipeline evaluate --model TARGET --draft {cfg.path} "
            "--prompts HELD_OUT.jsonl --out EVAL (acceptance and decode speed in vLLM; docs/evaluate.md)",
            err=True,
        )
    return summary


@click.command("verify")
@options(VerifyConfig)
def command(**kwargs) -> None:
    """Check any stage's output; write PATH/summary.json; exit non-zero on a failed check."""
    report(VerifyConfig(**kwargs))
