"""The hf backend's fused RMSNorms: which modules are fused (only those proven equal on a probe), that the
states do not change, and that ``close()`` gives every norm its own forward back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.backends import fused_norms
from pipeline.backends.base import BackendOptions
from pipeline.backends.hf import HFBackend
from pipeline.model.modeldir import read_model_dir
from tests.pipeline.test_extract import FP32_ATOL, FP32_RTOL, SEQS


class OnePlusWeightNorm(nn.Module):
    """Gemma's form: an RMS norm scaled by 1 + weight. Shaped like one, computes something else."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n) * 0.1)
        self.eps = 1e-6

    def forward(self, x):
        x32 = x.float()
        scale = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * scale * (1 + self.weight)).to(x.dtype)


class PlainRMSNorm(nn.Module):
    """Llama's form, eps under its name."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(n) + 0.5)
        self.variance_epsilon = 1e-6

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x32.to(x.dtype)


def test_only_norms_that_agree_with_the_fused_kernel_are_fused():
    """An RMS norm is fused; a Gemma-form norm, a layer norm without bias (shaped like an RMS norm: a 1-D
    weight and ``eps``) and a layer norm with bias are not, and keep their class's forward."""
    root = nn.ModuleDict(
        {
            "rms": PlainRMSNorm(64),
            "gemma": OnePlusWeightNorm(64),
            "ln_nobias": nn.LayerNorm(64, bias=False),
            "ln": nn.LayerNorm(64),
            "linear": nn.Linear(64, 64),
        }
    )
    assert [name for name, _, _ in fused_norms.candidates(root)] == ["rms", "gemma", "ln_nobias"]
    assert fused_norms.fuse(root) == ["rms"]
    assert "forward" in root["rms"].__dict__
    assert all("forward" not in root[n].__dict__ for n in ("gemma", "ln_nobias", "ln"))
    fused_norms.restore(root, ["rms"])
    assert "forward" not in root["rms"].__dict__


class GatedRMSNorm(PlainRMSNorm):
    """An RMS norm with an optional gate (Qwen3-Next's form): plain without it, gated with it."""

    def forward(self, x, gate=None):
        out = super().forward(x)
        return out if gate is None else out * torch.nn.functional.silu(gate)


def test_a_call_with_more_than_the_hidden_states_runs_the_module_s_own_forward():
    """The probe proves the plain call only: a gated call of a fused norm computes the gated norm."""
    norm = GatedRMSNorm(64).requires_grad_(False)
    x, gate = torch.randn(3, 64) + 1, torch.randn(3, 64)
    want_plain, want_gated = norm(x), norm(x, gate)
    assert fused_norms.fuse(norm) == [""]
    torch.testing.assert_close(norm(x), want_plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(norm(x, gate), want_gated, atol=0, rtol=0)
    torch.testing.assert_close(norm(x, gate=gate), want_gated, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_norm_computes_what_the_module_computes(dtype):
    """On inputs other than the probe: within fp32 summation order, or within bf16's roundings."""
    norm = PlainRMSNorm(256).to(dtype).requires_grad_(False)
    x = (torch.randn(5, 7, 256) * 3 - 1).to(dtype)
    want = norm(x)
    assert fused_norms.fuse(norm) == [""]
    got = norm(x)
    tol = fused_norms.TOLERANCE[dtype]
    assert float((got.float() - want.float()).abs().max() / want.float().abs().max()) <= tol


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_fused_norms_leave_the_states_as_they_were(family, tiny_llama, tiny_deepseek):
    """Every RMS norm of the tiny models is fused (two per layer and the final one; DeepSeek's MLA adds its
    query and key-value norms), and each sample's states equal the unfused path's (fp32); close() restores."""
    md = read_model_dir(tiny_llama if family == "llama" else tiny_deepseek)
    opts = dict(model=md, layer_ids=(2, 4, 5, 7), device="cpu", dtype="float32", compile=False)
    plain = HFBackend(BackendOptions(**opts, fused_norms=False))
    fused = HFBackend(BackendOptions(**opts, fused_norms=True))
    assert plain.fused_norms == []
    per_layer = {"llama": 2, "deepseek_v3": 4}[family]
    assert len(fused.fused_norms) == per_layer * md.num_layers + 1
    for seq, states in zip(SEQS, fused.capture(SEQS), strict=True):
        for got, want in zip(states, plain.capture([seq])[0], strict=True):
            torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=FP32_RTOL)
    decoder = fused.decoder
    fused.close()
    assert not any("forward" in m.__dict__ for m in decoder.modules())


def test_fused_norms_default_to_eager_gpu_runs_only(tiny_llama):
    """The default: on a GPU when the layers run eagerly; not compiled (inductor fuses the norms itself), not
    on the CPU; an explicit choice wins. A CPU backend built with the defaults fuses nothing."""
    from pipeline.backends.hf import should_fuse_norms

    assert should_fuse_norms(None, on_gpu=True, compiled=False)
    assert not should_fuse_norms(None, on_gpu=True, compiled=True)
    assert not should_fuse_norms(None, on_gpu=False, compiled=False)
    assert should_fuse_norms(True, on_gpu=False, compiled=True)
    assert not should_fuse_norms(False, on_gpu=True, compiled=False)
    md = read_model_dir(tiny_llama)
    backend = HFBackend(BackendOptions(model=md, layer_ids=(2,), device="cpu", dtype="float32"))
    assert backend.fused_norms == []
    backend.close()
