"""The hf backend's fused RMSNorms: each of a decoder's RMS norms that is proven to compute what torch's
``rms_norm`` computes runs through it instead of its own forward.

Transformers' RMSNorms (Llama's, Qwen's, DeepSeek's ...) run eagerly as six or seven kernels over the hidden
states (to fp32, square, mean, rsqrt, scale, back to the input dtype, times the weight), each reading and
writing the whole tensor; ``torch.nn.functional.rms_norm`` is one kernel on a GPU, computing in fp32 and
rounding once. Which modules are RMS norms is not read from class names (a Gemma norm multiplies by
``1 + weight``, and remote code can name anything anything): a module is a candidate when it has no
children, a 1-D ``weight``, an epsilon (``variance_epsilon`` or ``eps``) and no bias, and it is fused only
when its own forward and the fused kernel agree on a probe batch on the model's device and dtype. The rest
keep their forward. ``restore`` puts every forward back.
"""

from __future__ import annotations

import torch
from torch import nn

EPS_NAMES = ("variance_epsilon", "eps")
# a probe agrees when the largest difference is within this share of the largest output: a few roundings of
# the dtype (the eager norm rounds to the input dtype before its weight product, the fused one once)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def epsilon(module: nn.Module) -> float | None:
    """The module's epsilon, where it has one by a known name and it is a number."""
    for name in EPS_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, float | int) and not isinstance(value, bool):
            return float(value)
    return None


def candidates(root: nn.Module) -> list[tuple[str, nn.Module, float]]:
    """Leaf modules shaped like an RMS norm: a 1-D weight parameter, an epsilon and no bias."""
    found = []
    for name, module in root.named_modules():
        weight = getattr(module, "weight", None)
        eps = epsilon(module)
        if (
            eps is not None
            and isinstance(weight, nn.Parameter)
            and weight.dim() == 1
            and getattr(module, "bias", None) is None
            and next(module.children(), None) is None
        ):
            found.append((name, module, eps))
    return found


def fused_forward(module: nn.Module, eps: float):
    """The fused kernel as ``module``'s forward over the last dimension. A call with more than the hidden
    states (a gated norm's gate, say) goes to the class's own forward: the probe proved the plain call
    only."""
    weight, shape, own = module.weight, (module.weight.numel(),), type(module).forward

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs:
            return own(module, hidden_states, *args, **kwargs)
        return torch.nn.functional.rms_norm(hidden_states, shape, weight, eps)

    return forward


@torch.inference_mode()
def agrees(module: nn.Module, forward, seed: int = 0) -> bool:
    """Whether ``forward`` gives what ``module`` gives on a probe batch: 8 rows of random values with a mean
    far from zero (so that a layer norm, which subtracts it, cannot pass for an RMS norm), on the weight's
    device and in its dtype. A module (or a kernel) that cannot take the probe does not agree."""
    weight = module.weight
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(8, weight.numel(), generator=gen) * 2 + 3).to(device=weight.device, dtype=weight.dtype)
    try:
        want, got = module(x), forward(x)
    except Exception:  # noqa: BLE001 - a norm of another signature (or one the kernel refuses) keeps its own
        return False
    if not isinstance(want, torch.Tensor) or want.shape != x.shape:
        return False
    scale = want.float().abs().max().clamp_min(1e-30)
    err = (got.float() - want.float()).abs().max() / scale
    return bool(torch.isfinite(err)) and float(err) <= TOLERANCE.get(weight.dtype, 1e-5)


def fuse(root: nn.Module) -> list[str]:
    """Give every proven RMS norm under ``root`` the fused forward; the names of the modules fused."""
    fused = []
    for name, module, eps in candidates(root):
        forward = fused_forward(module, eps)
        if agrees(module, forward):
            module.forward = forward
            fused.append(name)
    return fused


def restore(root: nn.Module, names: list[str]) -> None:
    """Give the named modules back their class's forward."""
    modules = dict(root.named_modules())
    for name in names:
        modules[name].__dict__.pop("forward", None)
