"""The batch plan (pure): samples bucketed by length into batches of at most ``max_batch_tokens`` tokens
and ``max_batch_size`` samples, deterministically, so that a resumed run recomputes the same batches; this
host's shard of a multi-host run and one data-parallel worker's deal of it. Which batches are left on
resume is resume.py's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from contract.shards import shard


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
