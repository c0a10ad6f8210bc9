"""What a hidden-state capture computes, in FLOPs, and the fraction of the GPU's bf16 peak that a rate
reaches.

Extraction runs the decoder stack only: the embedding is a lookup (no multiply) and the lm_head is never
applied, so neither counts. A token costs 2 FLOPs (multiply and add) per decoder parameter it meets, and
causal attention adds, per layer and head, the dot products of each query with the keys at or before it
(QK^T) and as many for the weighted sum of values (PV): for a sample of T tokens, T(T+1)/2 query-key pairs,
each 2 x head_dim FLOPs twice. Only real tokens count, never padding. An MoE layer's experts would all be
counted as if every token met them; these figures are for dense decoders (every model benchmarked here).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

PEAK_BF16_FLOPS = 790e12  # H200 dense bf16: an 8192^3 bf16 matmul measured 769-798 TFLOP/s on these machines


def is_decoder_param(name: str) -> bool:
    """A parameter the captured forward multiplies by: everything but the embedding table and the lm_head."""
    return "embed_tokens" not in name and "lm_head" not in name


@dataclass(frozen=True)
class DecoderShape:
    """What the FLOP count needs to know about a model."""

    decoder_params: int  # parameters of the decoder layers and the final norm (no embedding, no lm_head)
    layers: int
    heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: dict, decoder_params: int) -> DecoderShape:
        text = config.get("text_config") or config
        heads = int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
        return cls(decoder_params, int(text["num_hidden_layers"]), heads, head_dim)

    def flops(self, lengths: Iterable[int]) -> int:
        """FLOPs of one forward over samples of these lengths (each sample attends to itself only)."""
        lengths = [int(t) for t in lengths]
        dense = 2 * self.decoder_params * sum(lengths)
        pairs = sum(t * (t + 1) // 2 for t in lengths)
        return dense + self.layers * self.heads * 4 * self.head_dim * pairs

    def roofline_fraction(
        self, lengths: Sequence[int], seconds: float, peak: float = PEAK_BF16_FLOPS
    ) -> float:
        """The share of ``peak`` that computing these samples in ``seconds`` reaches."""
        return self.flops(lengths) / seconds / peak


def checkpoint_decoder_params(model_dir: Path) -> int:
    """Decoder parameters of a safetensors checkpoint (one file or an index of shards), from the headers."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    total = 0
    for name in files:
        with safe_open(model_dir / name, framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - a safe_open handle has no __iter__
                if is_decoder_param(key):
                    n = 1
                    for d in fh.get_slice(key).get_shape():
                        n *= d
                    total += n
    return total


def model_shape(model_dir: Path) -> DecoderShape:
    """The FLOP-count shape of a saved model directory."""
    return DecoderShape.from_config(
        json.loads((model_dir / "config.json").read_text()), checkpoint_decoder_params(model_dir)
    )
