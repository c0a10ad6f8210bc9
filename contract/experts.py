"""What a model's config says of its routed experts: how many there are and how many one token meets.

Read alike by both sides: ops' layout weighs it in the backend rule (contract/backends.py) from the config
the preflight fetches, and the container from the model folder's config.json (pipeline/backends/choice.py,
pipeline/model/experts.py). Standard library only (contract/__init__.py).
"""

from __future__ import annotations

from collections.abc import Mapping

# how MoE families name their routed-expert count in config.json (DeepSeek-V3 / Kimi, Qwen-MoE and
# gpt-oss, Mixtral, ERNIE-MoE) and the count a token meets (most, gpt-oss's own, ERNIE's, Hunyuan's)
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
PER_TOKEN_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_k", "moe_topk")


def experts_met(config: Mapping | None) -> tuple[int, int]:
    """``(k, E)``: the routed experts a token meets and the routed experts there are; ``(0, 0)`` for a dense
    model or no config; ``(E, E)`` where the config gives no per-token count (every expert counted: the
    upper bound). A wrapper's ``text_config`` is looked into. A config that is not a JSON object (a damaged
    file, which the stage's own checks name) counts as dense here."""
    if not isinstance(config, Mapping):
        return (0, 0)
    text = config.get("text_config") or config
    if not isinstance(text, Mapping):
        return (0, 0)
    experts = next((_count(text[key]) for key in EXPERT_COUNT_KEYS if _count(text.get(key))), 0)
    if not experts:
        return (0, 0)
    k = next((_count(text[key]) for key in PER_TOKEN_KEYS if _count(text.get(key))), experts)
    return (k, experts)


def _count(value) -> int:
    """A positive count as configs write it (an int; ERNIE-VL's per-modality list: its first); else 0."""
    if isinstance(value, list | tuple):
        value = value[0] if value else 0
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _int(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def dequantized_extra_bytes(config: Mapping | None) -> int:
    """The bytes an MoE's routed experts gain when a loader dequantizes them to bf16 (transformers does, at
    load; vLLM runs its W4A16 kernels on them as stored): routed-expert parameters x (2 - num_bits / 8 -
    2 / group_size) for a ``compressed-tensors`` checkpoint whose weights are quantized to fewer than 16 bits
    (Kimi-K2's INT4 pack-quantized, group 32: 1.4375 bytes each). 0 for an unquantized, a dense or an
    unreadable config. Estimated from config.json alone (hidden_size, moe_intermediate_size, the MoE layers),
    so that ops' layout weighs it as the container does."""
    if not isinstance(config, Mapping):
        return 0
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    quant = text.get("quantization_config") or config.get("quantization_config")
    if not isinstance(quant, Mapping) or quant.get("quant_method") != "compressed-tensors":
        return 0
    groups = quant.get("config_groups")
    weights = (
        [g.get("weights") for g in groups.values() if isinstance(g, Mapping)]
        if isinstance(groups, Mapping)
        else []
    )
    weights = [
        w for w in weights if isinstance(w, Mapping) and _int(w.get("num_bits")) and w["num_bits"] < 16
    ]
    if not weights:
        return 0
    _, experts = experts_met(config)
    hidden = _int(text.get("hidden_size"))
    inter = _int(text.get("moe_intermediate_size")) or _int(text.get("intermediate_size"))
    layers = _int(text.get("num_hidden_layers"))
    dense = text.get("first_k_dense_replace")
    layers -= dense if isinstance(dense, int) and not isinstance(dense, bool) and 0 <= dense <= layers else 0
    params = experts * layers * 3 * hidden * inter
    bits, group = weights[0]["num_bits"], _int(weights[0].get("group_size")) or 128
    return int(params * (2 - bits / 8 - 2 / group)) if params else 0
