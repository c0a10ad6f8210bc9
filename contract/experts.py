"""What a model's config says of its routed experts: how many there are and how many one token meets.

Read alike by both sides: ops' layout weighs it in the backend rule (contract/backends.py) from the config
the preflight fetches, and the container from the model folder's config.json (pipeline/backends/choice.py,
pipeline/model/experts.py). Standard library only (contract/__init__.py).
"""

from __future__ import annotations

from collections.abc import Mapping

# how each MoE family names its routed-expert count (DeepSeek-V3 / Kimi, Qwen-MoE, Mixtral)
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")


def experts_met(config: Mapping | None) -> tuple[int, int]:
    """``(k, E)``: the routed experts a token meets and the routed experts there are; ``(0, 0)`` for a dense
    model or no config. A wrapper's ``text_config`` is looked into."""
    if not config:
        return (0, 0)
    text = config.get("text_config") or config
    experts = next((int(text[key]) for key in EXPERT_COUNT_KEYS if text.get(key)), 0)
    return (int(text.get("num_experts_per_tok") or 0), experts) if experts else (0, 0)
