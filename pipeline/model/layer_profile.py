"""Per-layer signatures of captured hidden states, and what one file's signatures say about its layers.

Owns the signature of one captured layer (the log of its median per-token RMS, and its mean over tokens),
the set's reference profile (built from a sample of the set's own files: element-wise medians, so one bad
file in the sample does not move it), and the per-file findings that a reference makes possible:

* out of order: the file's tensors fit the set's layers clearly better in another order than their own
  (swapped layers, or layers written in another order);
* dropped: a file with fewer tensors than layer ids: which layer id is missing (each present tensor is
  matched to its nearest layer, in order);
* scale: a layer whose RMS is over ``SCALE_FACTOR`` times off the set's (all zeros included).

The distance between a tensor and a layer's profile is ``1 - cos(mean, profile mean) + |log rms - profile
log rms|``. In a real model's residual stream both terms grow with the depth between layers; two layers
whose profiles are closer than a file's own spread (adjacent layers of a deep model) cannot be told apart
here, and files shorter than ``MIN_TOKENS`` are too noisy to judge the order of: the spot re-computation
(pipeline/model/recompute.py) catches those. Pure computation on tensors; reading files is verify's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

# torch only in annotations here: the functions that use it import it, so that a command that only parses its
# arguments (--help, check-args) never loads it (tests/pipeline/test_cli_imports.py)
if TYPE_CHECKING:
    import torch


SCALE_FACTOR = 4.0  # a layer's RMS this many times above or below the set's is a finding
ORDER_MARGIN = 0.05  # how much nearer another layer's profile a tensor must be to count as out of order
# ...and how much of its in-order distance the best reordering of a file's tensors must save: single tensors
# of an intact file are often nearer a neighbouring layer (a random or shallow model's adjacent layers look
# alike), so only a whole reordering that fits clearly better is a finding
ORDER_GAIN = 0.25
MIN_TOKENS = 16  # shorter files are not judged for order
MIN_REFERENCE_FILES = 3


def token_rms(h: torch.Tensor) -> torch.Tensor:
    """Per token (over the last dim) of a [..., T, H] state: its RMS, in float32 (what ``layer_stats`` takes
    the median of), on the state's device."""
    import torch

    return torch.linalg.vector_norm(h, dim=-1, dtype=torch.float32) / math.sqrt(max(1, h.shape[-1]))


def token_scales(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: ``token_rms`` and the count of non-finite entries, on the state's device. The hf backend
    computes them on the GPU for extract's writer record (``integrity.written_facts(..., scales=...)``)."""
    import torch

    return token_rms(h), (~torch.isfinite(h)).sum(-1, dtype=torch.int32)


@dataclass(frozen=True)
class LayerStats:
    """One captured tensor's signature."""

    log_rms: float  # log of the median over tokens of sqrt(mean(h^2)); -inf for an all-zero tensor
    mean: torch.Tensor  # float32[H], the mean over tokens


def layer_stats(h: torch.Tensor) -> LayerStats:
    import torch

    rms = token_rms(h)
    med = float(rms.median()) if rms.numel() else 0.0
    return LayerStats(math.log(med) if med > 0 else -math.inf, torch.mean(h, dim=0, dtype=torch.float32))


@dataclass(frozen=True)
class Reference:
    """The set's profile: per layer position, the median log RMS and the median mean vector (unit length)."""

    layer_ids: tuple[int, ...]
    log_rms: tuple[float, ...]
    means: tuple[torch.Tensor, ...]
    files: int


def build_reference(samples: list[list[LayerStats]], layer_ids: list[int]) -> Reference | None:
    """The profile of files that hold one finite, non-zero tensor per layer id; None with fewer than
    ``MIN_REFERENCE_FILES`` such files."""
    import torch

    good = [s for s in samples if len(s) == len(layer_ids) and all(math.isfinite(x.log_rms) for x in s)]
    if len(good) < MIN_REFERENCE_FILES:
        return None
    log_rms, means = [], []
    for j in range(len(layer_ids)):
        log_rms.append(float(torch.tensor([s[j].log_rms for s in good]).median()))
        m = torch.stack([s[j].mean for s in good]).median(dim=0).values
        means.append(m / m.norm().clamp_min(1e-30))
    return Reference(tuple(layer_ids), tuple(log_rms), tuple(means), len(good))


def distance(x: LayerStats, ref: Reference, k: int) -> float:
    if not math.isfinite(x.log_rms):
        return math.inf
    cos = float(x.mean @ ref.means[k] / x.mean.norm().clamp_min(1e-30))
    return (1.0 - cos) + abs(x.log_rms - ref.log_rms[k])


def order_problem(stats: list[LayerStats], ref: Reference, tokens: int) -> str | None:
    """Which positions hold another layer's states, or None: the assignment of the file's tensors to the set's
    layers with the least total distance, when it is not the file's own order and saves at least ORDER_GAIN
    of the in-order distance (and ORDER_MARGIN)."""
    from itertools import permutations

    n = len(ref.layer_ids)
    if tokens < MIN_TOKENS or len(stats) != n or n > 8:
        return None
    d = [[distance(x, ref, k) for k in range(n)] for x in stats]
    in_order = sum(d[j][j] for j in range(n))
    best = min(permutations(range(n)), key=lambda perm: sum(d[j][perm[j]] for j in range(n)))
    cost = sum(d[j][best[j]] for j in range(n))
    if not math.isfinite(in_order) or cost > in_order - max(ORDER_MARGIN, ORDER_GAIN * in_order):
        return None
    wrong = [
        f"hidden_states[{j}] (layer {ref.layer_ids[j]}) looks like layer {ref.layer_ids[best[j]]}"
        for j in range(n)
        if best[j] != j
    ]
    return "; ".join(wrong) + ": layers swapped or out of order"


def dropped_problem(stats: list[LayerStats], ref: Reference) -> str:
    """For a file with fewer tensors than layers: the layer ids missing, matching the tensors to layers in
    order (the assignment of increasing layer positions with the least total distance)."""
    n, m = len(stats), len(ref.layer_ids)
    if n >= m:
        return f"{n} tensors for {m} layer ids"
    # best[i][k]: least cost of placing tensors i.. at layer positions k.. (in order)
    inf = math.inf
    best = [[inf] * (m + 1) for _ in range(n + 1)]
    for k in range(m + 1):
        best[n][k] = 0.0
    for i in range(n - 1, -1, -1):
        for k in range(m - 1, -1, -1):
            best[i][k] = min(distance(stats[i], ref, k) + best[i + 1][k + 1], best[i][k + 1])
    kept, k = [], 0
    for i in range(n):
        while k < m - 1 and best[i][k] != distance(stats[i], ref, k) + best[i + 1][k + 1]:
            k += 1
        kept.append(k)
        k += 1
    missing = [ref.layer_ids[k] for k in range(m) if k not in kept]
    others = ", ".join(str(ref.layer_ids[k]) for k in kept)
    return f"layer {', '.join(map(str, missing))} missing (the {n} tensors present match layers {others})"


def scale_problem(stats: list[LayerStats], ref: Reference) -> str | None:
    """Layers whose RMS is off the set's by over SCALE_FACTOR (or that are all zeros)."""
    out = []
    for j, x in enumerate(stats[: len(ref.layer_ids)]):
        if x.log_rms == -math.inf:
            out.append(f"hidden_states[{j}] (layer {ref.layer_ids[j]}) is all zeros")
        elif math.isfinite(x.log_rms) and abs(x.log_rms - ref.log_rms[j]) > math.log(SCALE_FACTOR):
            ratio = math.exp(x.log_rms - ref.log_rms[j])
            out.append(
                f"hidden_states[{j}] (layer {ref.layer_ids[j]}) has RMS {math.exp(x.log_rms):.3g}, "
                f"{ratio:.3g}x the set's {math.exp(ref.log_rms[j]):.3g}"
            )
    return "; ".join(out) or None
