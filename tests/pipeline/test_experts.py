"""The parameters a token meets: an MoE's routed experts at k / E, by name and config, for each MoE family's
config keys; everything of a dense model."""

from __future__ import annotations

import pytest

from contract.experts import experts_met
from pipeline.model.experts import active_decoder_params, is_routed_expert_param


@pytest.mark.parametrize(
    "name, routed",
    [
        ("model.layers.3.mlp.experts.17.gate_proj.weight", True),  # on disk, one tensor per expert
        ("model.layers.3.mlp.experts.gate_up_proj", True),  # in memory, fused
        ("model.layers.3.mlp.shared_experts.up_proj.weight", False),
        ("model.layers.3.mlp.gate.weight", False),  # the router
        ("model.layers.0.mlp.down_proj.weight", False),
    ],
)
def test_a_routed_expert_is_told_by_its_name(name, routed):
    assert is_routed_expert_param(name) is routed


@pytest.mark.parametrize(
    "config, met",
    [
        ({"n_routed_experts": 64, "num_experts_per_tok": 6}, (6, 64)),  # DeepSeek-V3, Kimi
        ({"num_experts": 60, "num_experts_per_tok": 4}, (4, 60)),  # Qwen-MoE
        ({"num_local_experts": 8, "num_experts_per_tok": 2}, (2, 8)),  # Mixtral
        ({"text_config": {"n_routed_experts": 384, "num_experts_per_tok": 8}}, (8, 384)),  # a wrapper
        ({"num_local_experts": 128, "experts_per_token": 4}, (4, 128)),  # gpt-oss's own key
        ({"moe_num_experts": 64, "moe_k": 6}, (6, 64)),  # ERNIE-MoE
        ({"moe_num_experts": [64, 64], "moe_k": 6}, (6, 64)),  # ERNIE-VL: one count per modality
        ({"num_experts": 16, "moe_topk": 2}, (2, 16)),  # Hunyuan
        ({"n_routed_experts": 64}, (64, 64)),  # no per-token count: every expert counted
        ({"num_experts_per_tok": 8}, (0, 0)),  # no expert count: dense
        ({"num_experts": 0, "num_experts_per_tok": 2}, (0, 0)),  # a dense config of an MoE family
        ({"num_experts": None}, (0, 0)),
        ({"hidden_size": 4096}, (0, 0)),
        (None, (0, 0)),
        ([1, 2], (0, 0)),  # damaged files: the stages' own checks name them
        ({"text_config": [{"n_routed_experts": 8}]}, (0, 0)),
    ],
)
def test_each_family_gives_its_expert_counts(config, met):
    assert experts_met(config) == met


def test_a_token_meets_its_k_routed_experts_and_every_shared_weight():
    """Hand count: 2 routed experts of 100 each (k = 1 of 2 -> 100 met), a shared expert of 30, attention of
    50, a router of 4; the embedding and lm_head are not decoder parameters."""
    sizes = [
        ("model.embed_tokens.weight", 1000),
        ("model.layers.0.self_attn.q_proj.weight", 50),
        ("model.layers.0.mlp.gate.weight", 4),
        ("model.layers.0.mlp.shared_experts.up_proj.weight", 30),
        ("model.layers.0.mlp.experts.0.up_proj.weight", 100),
        ("model.layers.0.mlp.experts.1.up_proj.weight", 100),
        ("lm_head.weight", 1000),
    ]
    moe = {"n_routed_experts": 2, "num_experts_per_tok": 1}
    assert active_decoder_params(sizes, moe) == 50 + 4 + 30 + 100
    assert active_decoder_params(sizes, {}) == 50 + 4 + 30 + 200  # read as dense: every expert counts
