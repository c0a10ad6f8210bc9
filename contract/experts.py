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
