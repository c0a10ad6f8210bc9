"""Spot re-computation: K data files' states computed again through the hf backend, compared layer by layer.

Owns choosing the K files (at random, the seed reported so that a run can be repeated), the comparison
(per layer, the relative error ||stored - fresh|| / ||fresh|| against a tolerance set by the stored
dtype) and, for a file that fails it, the diagnosis: a stored tensor that matches another layer's fresh
states (swapped layers), or states that match the fresh ones shifted by a few tokens (an off-by-one
between input_ids and states), and how far the target moves from itself when that file is computed beside
another sample (a random MoE at bf16 moves as much as the tolerance: then its states cannot be confirmed, and
the message says so). The model is loaded once by the caller (verify) and handed in.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.checks import CheckResult, check

# torch only in annotations here: the functions that use it import it, so that a command that only parses its
# arguments (--help, check-args) never loads it (tests/pipeline/test_cli_imports.py)
if TYPE_CHECKING:
    import torch

DEFAULT_SAMPLES = 4
#: the stored dtype -> largest relative error accepted. Half types: the extract ran in bf16/fp16 (on a GPU,
#: perhaps another backend) and the recomputation in fp32 on the CPU or in the same dtype on a GPU: bf16
#: rounding over the depth of a large model stays within a few percent, a wrong layer or a shifted token
#: is of order 1. fp32: only summation order differs.
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}
MAX_SHIFT = 2


@dataclass(frozen=True)
class Comparison:
    """One file's per-layer relative errors and, when some exceed the tolerance, what they look like."""

    errors: list[float]
    diagnosis: str | None


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    import torch

    a, b = a.to(torch.float32), b.to(torch.float32)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare(
    stored: list[torch.Tensor], fresh: list[torch.Tensor], layer_ids: list[int], tol: float
) -> Comparison:
    errors = [
        rel_err(s, f) if s.shape == f.shape else float("inf") for s, f in zip(stored, fresh, strict=True)
    ]
    if all(e <= tol for e in errors):
        return Comparison(errors, None)
    notes = []
    for j, s in enumerate(stored):
        if errors[j] <= tol:
            continue
        others = [
            k
            for k in range(len(fresh))
            if k != j and fresh[k].shape == s.shape and rel_err(s, fresh[k]) <= tol
        ]
        if others:
            notes.append(
                f"hidden_states[{j}] (layer {layer_ids[j]}) "
                f"equals the recomputed layer {layer_ids[others[0]]}"
            )
            continue
        shift = _shift(s, fresh[j], tol)
        if shift is not None:
            notes.append(
                f"hidden_states[{j}] (layer {layer_ids[j]}) matches the recomputation shifted by "
                f"{shift:+d} token{'s' if abs(shift) > 1 else ''} (stored row t is row t{shift:+d})"
            )
        else:
            notes.append(f"hidden_states[{j}] (layer {layer_ids[j]}) differs by {errors[j]:.3g} > {tol:g}")
    return Comparison(errors, "; ".join(notes))


def _shift(s: torch.Tensor, f: torch.Tensor, tol: float) -> int | None:
    """The token shift d (|d| <= MAX_SHIFT) with stored[t] == fresh[t + d] over the overlap, if any."""
    t = s.shape[0]
    for d in (1, -1, 2, -2)[: 2 * MAX_SHIFT]:
        if t - abs(d) < 2:
            continue
        a, b = (s[: t - d], f[d:]) if d > 0 else (s[-d:], f[: t + d])
        if rel_err(a, b) <= tol:
            return d
    return None


def pick(indices: list[int], k: int, seed: int) -> list[int]:
    return sorted(random.Random(seed).sample(indices, min(k, len(indices))))


def spot_recompute(
    load,
    directory,
    picked: list[int],
    layer_ids: list[int],
    dtype: str,
    backend,
    tolerance: float | None = None,
) -> tuple[list[CheckResult], dict, dict]:
    """Recompute ``picked`` files through ``backend`` (an HFBackend over the set's layer ids) and compare:
    the checks, each file's per-layer relative errors, and for each failed file the target's own movement
    (``self_difference``)."""
    tol = tolerance if tolerance is not None else TOLERANCE.get(dtype, 0.1)
    out, stats, moved = [], {}, {}
    for i in picked:
        name = f"data_{i}.pt"
        d = load(directory / name)
        ids = d["input_ids"].tolist()
        stored = [h.clone() for h in d["hidden_states"]]
        fresh = backend.capture([ids])[0]
        if len(stored) != len(fresh):
            out.append(
                check("recompute", False, "", f"{len(stored)} stored tensors for {len(fresh)} layers", name)
            )
            continue
        c = compare(stored, fresh, layer_ids, tol)
        stats[name] = [round(e, 6) for e in c.errors]
        worst, why = max(c.errors), ""
        if c.diagnosis is not None:
            own = self_difference(backend, ids, fresh)
            moved[name] = [round(e, 6) for e in own]
            why = "; " + self_difference_note(own, c.errors, layer_ids, tol)
        out.append(
            check(
                "recompute",
                c.diagnosis is None,
                f"max relative error {worst:.3g} <= {tol:g} over layers {layer_ids}",
                f"stored states differ from the recomputation: {c.diagnosis}{why}",
                name,
            )
        )
    return out, stats, moved


# Padded tokens of the batch that a failed file is computed in once more: a quarter of extract's default
# forward (32,768). A batch of two was too small: on the H100 one sample beside its own first half came out
# bit-identical to itself alone, while extraction's batch (the whole set, 10,488 tokens) had moved it by 0.37,
# so verify blamed correct states (docs/benchmarks.md, "verify's own path on the GPU").
PROBE_TOKENS = 8192


def probe_batch(ids: list[int]) -> list[list[int]]:
    """The sample first, then copies of its own first half until the padded batch holds about
    ``PROBE_TOKENS`` tokens (at least one copy): the kernels' shapes (and with them their summation order and
    a MoE's tokens per expert) change as in an extraction batch, while the sample stays the longest row, so
    right padding never reaches it."""
    half = ids[: max(1, len(ids) // 2)]
    return [ids] + [half] * max(1, PROBE_TOKENS // max(1, len(ids)) - 1)


def self_difference(backend, ids: list[int], fresh: list[torch.Tensor]) -> list[float]:
    """Per layer, how far the target's own states for ``ids`` move when the sample is computed in a batch of
    others (``probe_batch``) instead of alone: the target's reproducibility, the floor under any stored set's
    error. A trained model in fp32 or bf16 stays near 0; a random MoE at bf16 routes its near-ties differently
    (0.15-0.30 at deep layers of dsv3-9b on an H100, docs/reliability.md)."""
    again = backend.capture(probe_batch(ids))[0]
    return [rel_err(a, f) if a.shape == f.shape else float("inf") for a, f in zip(again, fresh, strict=True)]


def self_difference_note(own: list[float], errors: list[float], layer_ids: list[int], tol: float) -> str:
    """What the target's own difference says about a failed comparison: the target is steady (the
    difference is the stored states'), or it moves by as much as the tolerance (its states cannot be
    confirmed to it: the stored error is then shown against the target's own)."""
    failing = [k for k, e in enumerate(errors) if e > tol]
    # a stored tensor of another shape (error inf) is the states' fault however much the target moves
    shaped = [k for k in failing if math.isinf(errors[k])]
    if shaped:
        at = ", ".join(str(layer_ids[k]) for k in shaped)
        return (
            f"the stored shape differs from the recomputation's at layer {at}: the states are at fault there"
        )
    steady = [k for k in failing if own[k] < tol / 2]
    if steady:
        at = ", ".join(str(layer_ids[k]) for k in steady)
        return (
            f"the target reproduces itself to {max(own[k] for k in steady):.2g} at layer {at} beside another "
            "sample: the states are at fault there"
        )
    j = max(range(len(own)), key=lambda k: own[k])
    ratio = max(errors[k] / own[k] for k in failing)
    return (
        f"the target itself moves by up to {own[j]:.3g} (layer {layer_ids[j]}) when computed beside another "
        f"sample (bf16 rounding flipping its near-ties): its states cannot be confirmed to {tol:g}; "
        f"the stored ones differ by {ratio:.2g}x that (docs/reliability.md)"
    )
