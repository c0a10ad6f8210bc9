"""Offline acceptance of a draft: how many of its proposals the target's own greedy decoding would keep.

Owns the measurement. For every held-out sample the target's captured states give, at each position,
the target's greedy next token (final norm + full lm_head on the last captured layer, the same arithmetic
as the verifier). The draft proposes k tokens per position from the captured auxiliary states, feeding
its own proposals back as in serving (speculators' training-time-test unroll, no teacher forcing); a
proposal counts only if it and every earlier proposal of that position equal the target's greedy tokens
at the matching future positions. Positions are those with loss_mask == 1 and k future targets.

Reported per draft (and per baseline): ``per_position[j]`` = share of positions whose first j+1 proposals
were all accepted, ``conditional[j]`` = the same given the first j were, and ``acceptance_length``
= 1 + sum(per_position) (vLLM's "mean acceptance length": accepted drafts plus the target's bonus token).

Baselines: ``untrained_draft`` (the same architecture at its seeded initialisation), ``unigram_target``
(always propose the token the target emits most often on training samples), ``most_frequent_token`` (the
most frequent assistant token of token_freq.pt), none of which looks at the context, and ``ngram_context``,
which does: vLLM's own ``method: ngram`` speculation (prompt lookup) on the tokens seen so far, the longest
suffix of 1..4 tokens that occurred before, its earliest occurrence, the k tokens that followed it there
(vllm/v1/spec_decode/ngram_proposer.py's rule; lengths 1..4 is the most generous offline setting, since a
proposal can only add accepted tokens). A draft that does not beat it buys nothing over what vLLM does
without a draft, which text that repeats itself (code, quoted context) makes a real risk.
It does not train or write checkpoints.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.errors import StageError


@dataclass(frozen=True)
class EvalConfig:
    """Options of the acceptance measurement."""

    out: Path  # train output dir (draft/, verifier/)
    k: int = 3  # draft tokens proposed per position
    max_samples: int = 64  # held-out samples measured
    seed: int = 0  # the untrained baseline's initialisation seed (the training seed)
    device: str = "cpu"
    attention: str | None = None  # ignored: measurement always uses the dense kernel (exact for any length)


@dataclass
class Tally:
    """Counts of accepted prefixes over positions."""

    k: int
    positions: int = 0
    prefix: np.ndarray | None = None  # prefix[j] = positions whose first j+1 proposals were all accepted

    def add(self, correct: torch.Tensor) -> None:
        """``correct``: bool [k, P] for P valid positions."""
        all_prefix = torch.cumprod(correct.to(torch.int64), dim=0).sum(dim=1).cpu().numpy()
        self.prefix = all_prefix if self.prefix is None else self.prefix + all_prefix
        self.positions += int(correct.shape[1])

    def result(self) -> dict:
        prefix = self.prefix if self.prefix is not None else np.zeros(self.k, dtype=np.int64)
        n = max(1, self.positions)
        per_position = [float(c) / n for c in prefix]
        conditional = [float(prefix[0]) / n] + [
            float(prefix[j]) / float(prefix[j - 1]) if prefix[j - 1] else 0.0 for j in range(1, self.k)
        ]
        return {
            "acceptance_length": 1.0 + sum(per_position),
            "per_position": per_position,
            "conditional": conditional,
            "positions": self.positions,
        }


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h32 = h.float()
    return (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)) * weight.float()


def greedy_tokens(
    last_hidden: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor, eps: float
) -> torch.Tensor:
    """The target's greedy next token at each position, from its last decoder layer's output."""
    return (rms_norm(last_hidden, norm, eps) @ lm_head.float().T).argmax(-1)


def correct_matrix(proposals: torch.Tensor, greedy: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """proposals int [k, T] (target ids), greedy int [T], positions int [P] -> bool [k, P].

    Proposal j made at position i is compared with the greedy token at i + j.
    """
    k = proposals.shape[0]
    rows = [proposals[j, positions] == greedy[positions + j] for j in range(k)]
    return torch.stack(rows)


def valid_positions(loss_mask: torch.Tensor, k: int) -> torch.Tensor:
    t = loss_mask.shape[0]
    idx = torch.arange(max(0, t - k + 1), device=loss_mask.device)
    return idx[loss_mask[: len(idx)].bool()]


class HeldOut:
    """Held-out samples in the draft's alignment (speculators' dataset + shift), with the target's greedy
    tokens."""

    def __init__(self, files: list[Path], verifier: dict, eps: float, device: torch.device):
        from pipeline.train.data import sample_dataset

        self.dataset = sample_dataset(files, max_len=1 << 30)
        self.norm = verifier["norm.weight"].to(device)
        self.lm_head = verifier["lm_head.weight"].to(device)
        self.eps = eps
        self.device = device

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self):
        from speculators.models.eagle3.data import shift_batch

        for i in range(len(self.dataset)):
            sample = self.dataset[i]
            item = {k: v.to(self.device) for k, v in shift_batch(sample).items()}
            item["context_ids"] = sample[
                "input_ids"
            ]  # unshifted: at shifted index i the context is [: i + 2]
            item["greedy"] = greedy_tokens(
                item["verifier_last_hidden_states"], self.norm, self.lm_head, self.eps
            )
            yield item


@torch.no_grad()
def draft_proposals(model, item: dict, k: int, d2t: torch.Tensor) -> torch.Tensor:
    """k proposals per position, as target ids: int [k, T]."""
    with torch.compiler.set_stance("force_eager"):  # speculators compiles forward on GPUs; lengths vary here
        tokens = model(
            hidden_states=item["hidden_states"].unsqueeze(0),
            input_ids=item["input_ids"].unsqueeze(0),
            document_ids=torch.zeros_like(item["input_ids"]).unsqueeze(0),  # one document
            position_ids=item["position_ids"].unsqueeze(0),
            ttt_steps=k,
        )
    draft_ids = torch.stack([t[0] for t in tokens])  # [k, T] in draft vocab
    return draft_ids + d2t[draft_ids]


def measure(samples: HeldOut, k: int, proposers: dict) -> dict[str, dict]:
    """Acceptance of each proposer (name -> fn(item) -> int [k, T] target ids) over the same positions."""
    tallies = {name: Tally(k) for name in proposers}
    for item in samples:
        pos = valid_positions(item["loss_mask"], k)
        if len(pos) == 0:
            continue
        for name, propose in proposers.items():
            tallies[name].add(correct_matrix(propose(item), item["greedy"], pos))
    return {name: t.result() for name, t in tallies.items()}


def target_unigram(samples: HeldOut, limit: int) -> int:
    counts: Counter[int] = Counter()
    for n, item in enumerate(samples):
        if n >= limit:
            break
        mask = item["loss_mask"].bool()
        counts.update(item["greedy"][mask].tolist())
    if not counts:
        raise StageError("no assistant positions in the training samples: cannot form the unigram baseline")
    return counts.most_common(1)[0][0]


def constant(token: int, k: int):
    def propose(item: dict) -> torch.Tensor:
        return torch.full(
            (k, item["input_ids"].shape[0]), token, dtype=torch.long, device=item["input_ids"].device
        )

    return propose


NGRAM_MIN, NGRAM_MAX = 1, 4


def ngram_continuations(
    tokens: list[int], k: int, n_min: int = NGRAM_MIN, n_max: int = NGRAM_MAX
) -> list[list[int]]:
    """Prompt lookup at every context length: entry L - 1 holds what vLLM's ngram proposer gives
    ``tokens[:L]``.

    For each prefix the longest suffix of n_min..n_max tokens that also occurs earlier (its occurrence
    ending before the prefix does), taken at its earliest occurrence; the proposal is the up to k tokens
    that followed it, never past the prefix's end; [] when nothing matches. One pass, O(len x n_max).
    """
    first_end: list[dict[tuple[int, ...], int]] = [
        {} for _ in range(n_max + 1)
    ]  # n-gram -> end of its first occurrence
    out: list[list[int]] = []
    for length in range(1, len(tokens) + 1):
        end = length - 1  # occurrences ending here are strictly before the suffix and have a continuation
        for n in range(1, n_max + 1):
            if end - n >= 0:
                first_end[n].setdefault(tuple(tokens[end - n : end]), end)
        proposal: list[int] = []
        for n in range(min(n_max, length), n_min - 1, -1):
            e = first_end[n].get(tuple(tokens[length - n : length]))
            if e is not None:
                proposal = tokens[e : min(e + k, length)]
                break
        out.append(proposal)
    return out


def ngram_context(k: int):
    """The ``ngram_context`` baseline: prompt lookup on the tokens known at each position (see
    ngram_continuations)."""

    def propose(item: dict) -> torch.Tensor:
        context = item["context_ids"].tolist()
        t = item["input_ids"].shape[0]
        out = torch.full((k, t), -1, dtype=torch.long)  # -1 never equals a greedy token: no proposal
        continuations = ngram_continuations(context, k)  # len(context) == t + 1
        for i in range(t):  # shifted index i knows context[: i + 2] and proposes context positions i + 2 ...
            if prop := continuations[i + 1]:
                out[: len(prop), i] = torch.tensor(prop)
        return out.to(item["input_ids"].device)

    return propose


def draft_vocab_coverage(samples: HeldOut, t2d: torch.Tensor, k: int) -> float:
    hit = total = 0
    for item in samples:
        pos = valid_positions(item["loss_mask"], k)
        g = item["greedy"][pos]
        hit += int(t2d[g].sum())
        total += int(len(g))
    return hit / total if total else 0.0


def evaluate_run(cfg: EvalConfig, inputs) -> dict:
    """Measure the exported draft of a train run and the baselines on its held-out samples."""
    from pipeline.train import draft as draft_mod
    from pipeline.train.data import seed_everything
    from pipeline.train.files import DRAFT, VERIFIER_VIEW

    device = torch.device(cfg.device)
    k = int(cfg.k)
    attention = draft_mod.DENSE_ATTENTION
    eps = inputs.target.rms_norm_eps
    eval_files = inputs.eval_files[: cfg.max_samples]
    held_out = HeldOut(eval_files, inputs.verifier, eps, device)
    d2t = torch.from_numpy(inputs.d2t).to(device)

    trained = draft_mod.load_draft(
        Path(cfg.out) / DRAFT, attention=attention, verifier_view=Path(cfg.out) / VERIFIER_VIEW
    ).to(device)
    seed_everything(cfg.seed)
    untrained = draft_mod.new_draft(trained.config, inputs.d2t, inputs.t2d).to(device).eval()

    unigram = target_unigram(
        HeldOut(inputs.train_files[: cfg.max_samples], inputs.verifier, eps, device), cfg.max_samples
    )
    proposers = {
        "draft": lambda item: draft_proposals(trained, item, k, d2t),
        "untrained_draft": lambda item: draft_proposals(untrained, item, k, d2t),
        "unigram_target": constant(unigram, k),
        "ngram_context": ngram_context(k),
    }
    if inputs.token_freq:
        frequent = max(inputs.token_freq.items(), key=lambda kv: (kv[1], -kv[0]))[0]
        proposers["most_frequent_token"] = constant(int(frequent), k)
    results = measure(held_out, k, proposers)
    draft = results.pop("draft")
    best = max(results, key=lambda n: results[n]["acceptance_length"])
    return {
        "k": k,
        "samples": len(eval_files),
        "positions": draft["positions"],
        "draft": draft,
        "baselines": results,
        "best_baseline": best,
        "beats_baseline": draft["acceptance_length"] > results[best]["acceptance_length"],
        "unigram_token": int(unigram),
        "greedy_in_draft_vocab": draft_vocab_coverage(held_out, torch.from_numpy(inputs.t2d).to(device), k),
    }


def table_rows(ev: dict) -> list[tuple[str, str, list[str]]]:
    """(name, acceptance length, per-position rates) for the draft and each baseline, for printing."""
    rows = [
        (
            "trained draft",
            f"{ev['draft']['acceptance_length']:.3f}",
            [f"{x:.3f}" for x in ev["draft"]["per_position"]],
        )
    ]
    for name, r in ev["baselines"].items():
        rows.append(
            (f"baseline: {name}", f"{r['acceptance_length']:.3f}", [f"{x:.3f}" for x in r["per_position"]])
        )
    return rows
