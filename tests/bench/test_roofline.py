"""The roofline's FLOP count equals a hand count: decoder parameters only, causal attention per real token."""

from __future__ import annotations

import json

from bench.roofline import DecoderShape, checkpoint_decoder_params, model_shape


def test_decoder_params_of_the_tiny_llama_equal_a_hand_count(tiny_llama):
    """The checkpoint count is the 8 layers' projections, MLPs and norms plus the final norm: no embedding, no
    lm_head."""
    # hidden 256, intermediate 512, 4 heads and 2 kv heads of 64: q and o 256x256, k and v 256x128
    attention = 2 * 256 * 256 + 2 * 256 * 128
    mlp = 3 * 256 * 512  # gate, up, down
    norms = 2 * 256  # input and post-attention RMSNorm weights
    assert checkpoint_decoder_params(tiny_llama) == 8 * (attention + mlp + norms) + 256
    shape = model_shape(tiny_llama)
    assert (shape.layers, shape.heads, shape.head_dim) == (8, 4, 64)
    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    assert shape.decoder_params < 8 * (attention + mlp + norms) + 256 + 2 * vocab * 256  # embeddings left out


def test_flops_of_two_samples_equal_a_hand_count():
    """2 FLOPs per parameter per token, plus 4 x head_dim per head, layer and causal query-key pair."""
    shape = DecoderShape(decoder_params=1000, layers=2, heads=3, head_dim=4)
    dense = 2 * 1000 * (3 + 5)
    # causal pairs (query i sees keys 0..i): 1+2+3 for T=3, 1+2+3+4+5 for T=5
    pairs = (1 + 2 + 3) + (1 + 2 + 3 + 4 + 5)
    attention = 2 * 3 * pairs * (2 * 4 + 2 * 4)  # layers x heads x pairs x (QK dot + PV weighted sum)
    assert shape.flops([3, 5]) == dense + attention == 16000 + 2016
    # a second a 1e15-FLOP run spends at 790 TFLOP/s: 1.27 s
    assert abs(DecoderShape(5 * 10**14, 1, 1, 1).roofline_fraction([1], 1.0 / 0.79) - 1.0) < 1e-3


def test_an_moe_token_counts_only_its_routed_experts(tiny_deepseek):
    """The tiny DeepSeek-V3 layout: of its 7 MoE layers' 8 routed experts (3 x 256 x 128 each) a token meets
    2, so they count a quarter; MLA's heads are 192 for queries and keys, 128 for values."""
    shape = model_shape(tiny_deepseek)
    routed = 7 * 8 * 3 * 256 * 128
    assert shape.routed_params == routed
    assert (shape.experts, shape.experts_per_token, shape.head_dim, shape.value_dim) == (8, 2, 192, 128)
    assert shape.active_params == shape.decoder_params - routed + routed // 4
    pairs = 1 + 2 + 3
    attention = 8 * 4 * pairs * (2 * 192 + 2 * 128)  # layers x heads x pairs x (QK dot + PV sum)
    assert shape.flops([3]) == 2 * shape.active_params * 3 + attention
    dense = DecoderShape(shape.decoder_params, 8, 4, 192, 128)  # the same model counted as if dense
    assert dense.flops([3]) - shape.flops([3]) == 2 * (routed - routed // 4) * 3
