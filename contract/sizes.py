"""How many bytes an extracted hidden-state set takes on disk, for the free-disk checks on both sides.

Per token: the captured layers' states (``layers`` x hidden x the dtype's width) plus input_ids and
loss_mask (int64 each); per file: the torch container's own overhead. ``auto`` counts as bfloat16 (what
a GPU run writes); a host of ``world_size`` writes about 1/world_size of the set."""

from __future__ import annotations

CAPTURED_LAYERS = 4  # EAGLE-3: three auxiliary layers and the last
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}
PER_FILE_OVERHEAD = 2048  # zip/pickle framing of one data_{i}.pt, measured on the demo's files
IDS_AND_MASK_BYTES = 2 * 8


def dtype_bytes(dtype: str | None) -> int:
    """Bytes per value of a ``--dtype`` choice (unknown or unset: bfloat16's 2)."""
    return DTYPE_BYTES.get(dtype or "auto", 2)


def hidden_states_bytes(
    num_tokens: int,
    num_samples: int,
    hidden_size: int,
    dtype: str | None = "auto",
    world_size: int = 1,
    layers: int = CAPTURED_LAYERS,
) -> int:
    """Expected bytes of one host's share of a set of ``num_samples`` samples, ``num_tokens`` tokens in
    all."""
    per_token = layers * hidden_size * dtype_bytes(dtype) + IDS_AND_MASK_BYTES
    total = num_tokens * per_token + num_samples * PER_FILE_OVERHEAD
    return -(-total // max(1, world_size))
