"""The draft vocabulary: token frequencies and the d2t/t2d mapping between draft and target ids.

Owns how the draft vocabulary is chosen (the most frequent assistant tokens) and the invariants every
mapping must satisfy. Reading and writing the files is pipeline/ondisk/formats.py's job.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from pipeline.errors import StageError


def token_frequencies(token_ids: np.ndarray, loss_mask: np.ndarray) -> dict[int, int]:
    """Counts of each token id over positions where the loss mask is 1."""
    counts = np.bincount(np.asarray(token_ids)[np.asarray(loss_mask) == 1].astype(np.int64))
    nz = np.nonzero(counts)[0]
    return {int(t): int(counts[t]) for t in nz}


def build_vocab_mapping(
    freq: dict[int, int], target_vocab: int, draft_vocab: int
) -> tuple[np.ndarray, np.ndarray]:
    """Pick the ``draft_vocab`` most frequent tokens (ties: lower id first; unseen tokens fill up by id).

    Returns ``d2t`` (int64[draft_vocab], target id = i + d2t[i]) and ``t2d`` (bool[target_vocab]).
    """
    if not 0 < draft_vocab <= target_vocab:
        raise StageError(
            f"--draft-vocab-size {draft_vocab} must be between 1 and the target vocab size {target_vocab}"
        )
    bad = [t for t in freq if not 0 <= t < target_vocab]
    if bad:
        raise StageError(
            f"token ids {bad[:5]} are outside the target vocab of {target_vocab}: "
            "tokenizer and model config disagree"
        )
    ranked = sorted(Counter(freq).items(), key=lambda kv: (-kv[1], kv[0]))
    chosen = [t for t, _ in ranked[:draft_vocab]]
    if len(chosen) < draft_vocab:
        seen = set(chosen)
        chosen += [t for t in range(target_vocab) if t not in seen][: draft_vocab - len(chosen)]
    target_ids = np.sort(np.asarray(chosen, dtype=np.int64))
    d2t = target_ids - np.arange(draft_vocab, dtype=np.int64)
    t2d = np.zeros(target_vocab, dtype=bool)
    t2d[target_ids] = True
    check_vocab_mapping(d2t, t2d, draft_vocab, target_vocab)
    return d2t, t2d


def vocab_mapping_problems(
    d2t: np.ndarray, t2d: np.ndarray, draft_vocab: int | None, target_vocab: int | None
) -> list[str]:
    """Every broken invariant of a mapping, as short sentences; empty when the mapping is sound."""
    problems = []
    if d2t.ndim != 1 or t2d.ndim != 1:
        return [f"d2t and t2d must be 1-D, got shapes {d2t.shape} and {t2d.shape}"]
    if t2d.dtype != np.bool_:
        problems.append(f"t2d dtype is {t2d.dtype}, expected bool")
    if not np.issubdtype(d2t.dtype, np.integer):
        problems.append(f"d2t dtype is {d2t.dtype}, expected int64")
        return problems
    if draft_vocab is not None and len(d2t) != draft_vocab:
        problems.append(f"len(d2t) = {len(d2t)} but the draft vocab size is {draft_vocab}")
    if target_vocab is not None and len(t2d) != target_vocab:
        problems.append(f"len(t2d) = {len(t2d)} but the target vocab size is {target_vocab}")
    if int(t2d.sum()) != len(d2t):
        problems.append(f"t2d.sum() = {int(t2d.sum())} but len(d2t) = {len(d2t)}")
    targets = np.arange(len(d2t), dtype=np.int64) + d2t.astype(np.int64)
    if len(targets) and (np.any(np.diff(targets) <= 0)):
        problems.append("arange + d2t is not strictly ascending (unsorted or duplicate target ids)")
    if len(targets) and (targets.min() < 0 or targets.max() >= len(t2d)):
        problems.append("arange + d2t points outside the target vocab")
    elif not problems and not np.array_equal(targets, np.nonzero(t2d)[0]):
        problems.append("arange + d2t differs from nonzero(t2d)")
    return problems


def check_vocab_mapping(
    d2t: np.ndarray, t2d: np.ndarray, draft_vocab: int | None, target_vocab: int | None
) -> None:
    problems = vocab_mapping_problems(d2t, t2d, draft_vocab, target_vocab)
    if problems:
        raise StageError("vocab mapping invalid: " + "; ".join(problems))
