"""What a hidden-state capture computes, in FLOPs, and the fraction of the GPU's bf16 peak that a rate
reaches.

Extraction runs the decoder stack only: the embedding is a lookup (no multiply) and the lm_head is never
applied, so neither counts. A token costs 2 FLOPs (multiply and add) per decoder parameter it meets, and
causal attention adds, per layer and head, the dot products of each query with the keys at or before it
(QK^T) and as many for the weighted sum of values (PV): for a sample of T tokens, T(T+1)/2 query-key pairs,
each 2 x the query-key head size (QK^T) plus 2 x the value head size (PV) FLOPs (MLA's 192 and 128, a Llama's
head_dim both). Only real tokens count, never padding. In an MoE layer a token meets its ``k`` routed experts
of ``E``, not all of them: the routed experts' parameters count k / E times (the router and the shared
experts, which every token meets, in full).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from contract.experts import experts_met
from pipeline.model.experts import active_params, is_decoder_param, is_routed_expert_param

PEAK_BF16_FLOPS = 790e12  # H200 dense bf16: an 8192^3 bf16 matmul measured 769-798 TFLOP/s on these machines


@dataclass(frozen=True)
class DecoderShape:
    """What the FLOP count needs to know about a model."""

    decoder_params: int  # parameters of the decoder layers and the final norm (no embedding, no lm_head)
    layers: int
    heads: int
    head_dim: int  # the query-key head size (MLA: nope + rope)
    value_dim: int | None = None  # the value head size where it differs (MLA's v_head_dim)
    routed_params: int = 0  # of decoder_params, the routed experts'
    experts_per_token: int = 0  # k of the E routed experts (0: a dense model)
    experts: int = 0

    @classmethod
    def from_config(cls, config: dict, decoder_params: int, routed_params: int = 0) -> DecoderShape:
        text = config.get("text_config") or config
        heads = int(text["num_attention_heads"])
        if text.get("qk_nope_head_dim") is not None:  # MLA: queries and keys of nope + rope, values apart
            head_dim = int(text["qk_nope_head_dim"]) + int(text["qk_rope_head_dim"])
            value_dim = int(text["v_head_dim"])
        else:
            head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
            value_dim = None
        k, experts = experts_met(text)
        return cls(
            decoder_params,
            int(text["num_hidden_layers"]),
            heads,
            head_dim,
            value_dim,
            routed_params,
            k,
            experts,
        )

    @property
    def active_params(self) -> float:
        """The decoder parameters one token meets: the routed experts' share k / E of theirs."""
        return active_params(self.decoder_params, self.routed_params, self.experts_per_token, self.experts)

    def flops(self, lengths: Iterable[int]) -> int:
        """FLOPs of one forward over samples of these lengths (each sample attends to itself only)."""
        lengths = [int(t) for t in lengths]
        dense = round(2 * self.active_params * sum(lengths))
        pairs = sum(t * (t + 1) // 2 for t in lengths)
        per_pair = 2 * self.head_dim + 2 * (self.value_dim or self.head_dim)  # QK^T dot, PV weighted sum
        return dense + self.layers * self.heads * per_pair * pairs

    def roofline_fraction(
        self, lengths: Sequence[int], seconds: float, peak: float = PEAK_BF16_FLOPS
    ) -> float:
        """The share of ``peak`` that computing these samples in ``seconds`` reaches."""
        return self.flops(lengths) / seconds / peak


def checkpoint_decoder_params(model_dir: Path, which=is_decoder_param) -> int:
    """Decoder parameters of a safetensors checkpoint (one file or an index of shards), from the headers;
    ``which``: those of the names it accepts (the routed experts': ``is_routed_expert_param``)."""
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
                if which(key):
                    n = 1
                    for d in fh.get_slice(key).get_shape():
                        n *= d
                    total += n
    return total


def model_shape(model_dir: Path) -> DecoderShape:
    """The FLOP-count shape of a saved model directory."""
    return DecoderShape.from_config(
        json.loads((model_dir / "config.json").read_text()),
        checkpoint_decoder_params(model_dir),
        checkpoint_decoder_params(model_dir, is_routed_expert_param),
    )
