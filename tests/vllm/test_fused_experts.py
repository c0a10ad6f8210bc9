"""vLLM's fused MoE kernel in the hf backend (pipeline/backends/fused_experts.py), against the pinned vLLM.

On the CPU the kernel is there by name but cannot run: nothing is fused and ``on`` fails in one line. On a GPU
(marked gpu) every routed-experts module of a DeepSeek-V3 runs through it by default, and its bf16 states are
as close to fp32 ones as transformers' own experts' are."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.backends import fused_experts
from pipeline.backends.base import BackendOptions
from pipeline.backends.hf import HFBackend
from pipeline.errors import StageError
from pipeline.model.modeldir import read_model_dir
from tests.pipeline.test_extract import SEQS

pytestmark = pytest.mark.vllm


def backend(model_dir, **kw) -> HFBackend:
    model = read_model_dir(model_dir)
    return HFBackend(BackendOptions(model=model, layer_ids=(0, 1, model.num_layers - 1), **kw))


def test_the_kernel_is_vllm_s_fused_experts():
    """The import path names vLLM 0.32's own function (a vLLM that moved it would leave every MoE unfused)."""
    kernel = fused_experts.kernel()
    assert kernel is not None
    assert kernel.__module__.startswith("vllm.model_executor.layers.fused_moe")


def test_on_the_cpu_nothing_is_fused_and_on_fails(tiny_deepseek):
    """vLLM's kernel does not run on the CPU (the CPU build has no Triton; the GPU build's Triton takes CUDA
    tensors only): the probe refuses it, so no module is fused, and asking for it fails in one line."""
    b = backend(tiny_deepseek, device="cpu", fused_experts=None)
    try:
        assert fused_experts.candidates(b.decoder)
        assert fused_experts.fuse(b.decoder, tokens=65536)[:2] == ([], None)
    finally:
        b.close()
    with pytest.raises(StageError, match="--fused-experts on"):
        backend(tiny_deepseek, device="cpu", fused_experts=True)


def rel_errors(got, want) -> list[float]:
    """Per sample and layer, the relative (Frobenius) error of ``got`` against ``want``."""
    return [
        float((g.float() - w.float()).norm() / w.float().norm())
        for gs, ws in zip(got, want, strict=True)
        for g, w in zip(gs, ws, strict=True)
    ]


@pytest.mark.gpu
def test_on_a_gpu_every_experts_module_is_fused_and_states_hold(tiny_deepseek):
    """The default (auto) on a GPU fuses every routed-experts module, the probe within the bf16 tolerance; its
    states are within 1.5x (plus one bf16 rounding) of the unfused bf16 states' distance to fp32 ones."""
    exact = backend(tiny_deepseek, dtype="float32", fused_experts=False)
    try:
        reference = exact.capture(SEQS)
    finally:
        exact.close()
    plain = backend(tiny_deepseek, dtype="bfloat16", fused_experts=False)
    try:
        unfused = plain.capture(SEQS)
    finally:
        plain.close()
    cudnn_sdp = torch.backends.cuda.cudnn_sdp_enabled()
    fused = backend(tiny_deepseek, dtype="bfloat16")
    assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn_sdp  # vLLM's import turns it off; we keep it
    try:
        assert fused.fused_experts == [n for n, _ in fused_experts.candidates(fused.decoder)]
        assert fused.fused_experts and fused.fused_experts_error <= fused_experts.TOLERANCE[torch.bfloat16]
        got = fused.capture(SEQS)
    finally:
        fused.close()
    base, mine = max(rel_errors(unfused, reference)), max(rel_errors(got, reference))
    probe = fused.fused_experts_error
    print(f"\nworst rel. error vs fp32: unfused {base:.3g}, fused {mine:.3g}; probe {probe:.3g}")
    assert mine <= 1.5 * base + 4e-3, (mine, base)


@pytest.mark.gpu
def test_on_a_gpu_the_tiles_are_timed_and_compute_what_the_default_computes(
    tiny_deepseek, tmp_path, monkeypatch
):
    """Where vLLM ships no tiles for the experts' shape (none for a tiny model's), the backend times vLLM's
    default against ``TILES`` on a batch of the loop's size and records it, and keeps the choice under vLLM's
    cache root, where a second backend takes it; a large batch through the fused forward with the chosen
    tiles matches the default tiles within the bf16 tolerance."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    b = backend(tiny_deepseek, dtype="bfloat16", max_batch_tokens=8192)
    try:
        (report,) = b.fused_experts_tiles.values()
        print(f"\ntiles timed: {report}")
        assert report["tokens"] == 8192 and report["default_ms"] > 0 and "kept" not in report
        assert len(json.loads((tmp_path / fused_experts.TILES_FILE).read_text())) == 1
        again = backend(tiny_deepseek, dtype="bfloat16", max_batch_tokens=8192)  # a rerun on this host
        try:
            (kept,) = again.fused_experts_tiles.values()
            assert kept == report | {"kept": True}
        finally:
            again.close()
        assert sum(ms is not None for ms in report["tiles_ms"]) >= 1  # at least one set runs on any CUDA GPU
        _, module = fused_experts.candidates(b.decoder)[0]
        batch = fused_experts.routed_batch(module, 8192, seed=3)
        kernel, override = fused_experts.kernel(), fused_experts.tile_override()
        with override(None):
            want = fused_experts.fused_forward(module, kernel)(*batch).float()
        for tiles in fused_experts.TILES:
            try:
                got = fused_experts.fused_forward(module, kernel, tiles)(*batch).float()
            except Exception:  # noqa: BLE001 - a set this GPU cannot run (the tuner skips it too)
                continue
            assert (
                float((got - want).abs().max() / want.abs().max()) <= fused_experts.TOLERANCE[torch.bfloat16]
            )
    finally:
        b.close()
