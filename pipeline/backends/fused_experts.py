"""The hf backend's fused MoE experts: each routed-experts module of a decoder that is proven to compute what
vLLM's fused MoE kernel computes runs through that kernel instead of transformers' experts forward.

Transformers 5.19 runs an MoE's routed experts (``grouped_mm``, its default) as a sort of the token-expert
pairs, a gather of each pair's row, two grouped GEMMs with the SiLU between them, the routing weights, the
unsort and a sum over the top-k: on dsv3-9b a third of the loop's kernel time was that glue around the GEMMs
(docs/benchmarks.md, "The hf backend's MoE loop, by kind of kernel"). vLLM's ``fused_experts`` (Triton) reads
each pair's row inside its first GEMM and applies the routing weight inside its second: the kernel vLLM's own
engine runs for the same layers.

A module is a candidate when it holds its experts as transformers lays them out
(``use_experts_implementation``): a 3-D ``gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and
``down_proj`` [E, H, I], no biases, not transposed, a gate, and SiLU as its activation; that is vLLM's w1 / w2
layout. It is fused only when its own forward and the kernel agree on a probe batch on the model's device
and dtype; the rest keep their forward. The kernel needs vLLM and a GPU: without either nothing is fused.
``restore`` puts every forward back.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pipeline.backends.fused_norms import restore  # noqa: F401 - the same: each named module's own forward back

# a probe agrees when the largest difference is within this share of the largest output: a few roundings of
# the dtype (both paths accumulate each GEMM in fp32; they round the intermediate and the sum differently)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}
PROBE_TOKENS = 256


def kernel():
    """vLLM's fused experts function, or None where vLLM (or its fused MoE) cannot be imported. Importing it
    leaves torch's attention choice as it was: vLLM's CUDA platform module turns torch's cuDNN attention off
    for the whole process (vllm/platforms/cuda.py), which moved dsv3-9b's attention to a kernel 4x slower."""
    cudnn_sdp = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
    except Exception:  # noqa: BLE001 - no vLLM, or a build without the kernel: the experts keep their forward
        return None
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp)
    return fused_experts


def is_silu(act) -> bool:
    """Whether ``act`` computes SiLU (transformers has its own classes for it, so its values decide)."""
    if not callable(act):
        return False
    x = torch.linspace(-6, 6, 49)
    try:
        y = act(x)
    except Exception:  # noqa: BLE001 - not an elementwise activation
        return False
    return isinstance(y, torch.Tensor) and y.shape == x.shape and torch.allclose(y, nn.functional.silu(x))


def candidates(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Experts modules laid out as vLLM's fused kernel reads them (see the module docstring)."""
    found = []
    for name, module in root.named_modules():
        w1, w2 = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(w1, nn.Parameter) and isinstance(w2, nn.Parameter)):
            continue
        if w1.dim() != 3 or w2.dim() != 3:
            continue
        experts, two_i, hidden = w1.shape
        if two_i % 2 or w2.shape != (experts, hidden, two_i // 2):
            continue
        if getattr(module, "has_bias", True) or getattr(module, "is_transposed", True):
            continue
        if not (getattr(module, "has_gate", False) and getattr(module, "is_concatenated", False)):
            continue
        if not is_silu(getattr(module, "act_fn", None)):
            continue
        found.append((name, module))
    return found


def fused_forward(module: nn.Module, fused_experts):
    """The fused kernel as ``module``'s forward: (hidden_states [T, H], top_k_index [T, k], top_k_weights
    [T, k]) -> [T, H], as transformers' experts forward takes and returns them."""
    w1, w2 = module.gate_up_proj, module.down_proj

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return fused_experts(
            hidden_states.contiguous(), w1, w2, top_k_weights.float(), top_k_index.to(torch.int32)
        )

    return forward


def top_k(module: nn.Module) -> int:
    """The experts each token meets, from the config transformers gives the module (2 where it has none)."""
    k = getattr(getattr(module, "config", None), "num_experts_per_tok", None)
    experts = module.gate_up_proj.shape[0]
    return min(k, experts) if isinstance(k, int) and k > 0 else min(2, experts)


@torch.inference_mode()
def probe_error(module: nn.Module, forward, seed: int = 0) -> float | None:
    """The largest difference between ``forward`` and ``module``'s own forward on a probe batch (random rows,
    each routed to k distinct random experts with random positive weights), as a share of the largest output;
    None where either cannot take the probe."""
    w1 = module.gate_up_proj
    experts, _, hidden = w1.shape
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(PROBE_TOKENS, hidden, generator=gen).to(device=w1.device, dtype=w1.dtype)
    k = top_k(module)
    index = torch.rand(PROBE_TOKENS, experts, generator=gen).topk(k, dim=-1).indices.to(w1.device)
    weights = (torch.rand(PROBE_TOKENS, k, generator=gen) + 0.1).to(w1.device)
    try:
        want, got = module(x, index, weights), forward(x, index, weights)
    except Exception:  # noqa: BLE001 - a module of another signature (or one the kernel refuses) keeps its own
        return None
    if not isinstance(want, torch.Tensor) or want.shape != x.shape or got.shape != x.shape:
        return None
    scale = want.float().abs().max().clamp_min(1e-30)
    err = float((got.float() - want.float()).abs().max() / scale)
    return err if math.isfinite(err) else None


def fuse(root: nn.Module) -> tuple[list[str], float | None]:
    """Give every proven experts module under ``root`` the fused forward: the names of the modules fused, and
    the worst probe error among them (None when none was fused)."""
    candidates_found = candidates(root)
    fused_experts = kernel() if candidates_found else None
    if fused_experts is None:
        return [], None
    fused, worst = [], None
    for name, module in candidates_found:
        forward = fused_forward(module, fused_experts)
        err = probe_error(module, forward)
        if err is not None and err <= TOLERANCE.get(module.gate_up_proj.dtype, 1e-4):
            module.forward = forward
            fused.append(name)
            worst = err if worst is None else max(worst, err)
    return fused, worst
