"""contract/: the shard rule and the on-disk size formula both sides use (the summary record has its own
file)."""

from __future__ import annotations

import pytest

from contract import sizes
from contract.shards import shard


@pytest.mark.parametrize(("samples", "world"), [(0, 1), (1, 3), (10, 1), (10, 3), (7, 7), (5, 8)])
def test_shards_are_disjoint_and_cover_every_sample(samples, world):
    """Any host count: the shards do not overlap and their union is every sample, in order within a host."""
    parts = [list(shard(samples, rank, world)) for rank in range(world)]
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(samples))
    assert all(p == sorted(p) and all(i % world == r for i in p) for r, p in enumerate(parts))


@pytest.mark.parametrize(("rank", "world"), [(-1, 2), (2, 2), (0, 0)])
def test_a_rank_outside_the_world_is_refused(rank, world):
    """A rank that no host of the world has is an error, not an empty shard."""
    with pytest.raises(ValueError, match="rank"):
        shard(10, rank, world)


def test_hidden_states_bytes_counts_states_ids_mask_and_files():
    """4 layers x hidden x dtype bytes + int64 ids and mask per token, a per-file overhead; auto is bf16."""
    assert sizes.hidden_states_bytes(1000, 10, 256, "bfloat16") == 1000 * (4 * 256 * 2 + 16) + 10 * 2048
    assert sizes.hidden_states_bytes(1000, 10, 256, "float32") == 1000 * (4 * 256 * 4 + 16) + 10 * 2048
    assert sizes.hidden_states_bytes(1000, 10, 256, "auto") == sizes.hidden_states_bytes(
        1000, 10, 256, "bfloat16"
    )
    assert sizes.hidden_states_bytes(1000, 10, 256, None) == sizes.hidden_states_bytes(
        1000, 10, 256, "bfloat16"
    )


def test_a_host_of_several_needs_its_share_rounded_up():
    """A host of world size N needs 1/N of the set, never less (rounded up)."""
    whole = sizes.hidden_states_bytes(1001, 3, 7, "float32")
    share = sizes.hidden_states_bytes(1001, 3, 7, "float32", world_size=2)
    assert share * 2 >= whole > (share - 1) * 2


def test_the_stage_table_in_docs_is_the_contracts():
    """docs/ops.md's stage table is contract.stages' own rendering, so the two cannot disagree."""
    from pathlib import Path

    from contract.stages import markdown_table

    doc = (Path(__file__).resolve().parent.parent / "docs" / "ops.md").read_text()
    block = doc.split("<!-- stages:begin", 1)[1].split("-->\n", 1)[1].split("<!-- stages:end -->", 1)[0]
    assert block == markdown_table(), (
        "re-render it: python -c 'import contract.stages as s; print(s.markdown_table())'"
    )
