"""Which samples a host owns when several hosts write one set: sample i belongs to rank i % world_size.

Any host count yields disjoint shards whose union is every sample, and a host's shard does not depend on
the others' progress, so hosts can start, resume and be verified independently."""

from __future__ import annotations


def shard(num_samples: int, rank: int, world_size: int) -> range:
    """The sample indices host ``rank`` of ``world_size`` owns (all of them for a single host)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1} (world size {world_size})")
    return range(rank, num_samples, world_size)
