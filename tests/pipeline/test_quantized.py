"""A quantized target through the stages (issue #51): the tiny DeepSeek-V3 / Kimi-K2.5 layout with its routed
experts INT4 pack-quantized (compressed-tensors, group 32; pipeline/demo/quantized.py).

The hf backend needs the compressed-tensors package (requirements/dev.txt); where it is missing, the tests
that need it skip and the refusal tests still run. The vLLM CPU build's refusal is tests/vllm/
test_quantized_vllm.py's."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.conftest import PYTHON, REPO, run_pipeline

ROUTED = ("gate_proj", "up_proj", "down_proj")

# `python -m pipeline ...` in an env where compressed-tensors cannot be imported (a finder that refuses it),
# what a light env without the package is
WITHOUT_CT = """
import runpy, sys
class NoCompressedTensors:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "compressed_tensors":
            raise ModuleNotFoundError("No module named 'compressed_tensors'", name=name)
sys.meta_path.insert(0, NoCompressedTensors())
sys.argv = ["pipeline", *sys.argv[1:]]
runpy.run_module("pipeline", run_name="__main__", alter_sys=True)
"""


def run_without_ct(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    return subprocess.run(
        [PYTHON, "-c", WITHOUT_CT, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=600,
    )


@pytest.fixture(scope="module")
def quant(tmp_path_factory) -> Path:
    """The tiny quantized DeepSeek-V3 layout, its prepared set (24 samples of <= 127 tokens) and weights."""
    from pipeline.demo.quantized import build_quantized_model
    from pipeline.demo.tiny import write_conversations

    work = tmp_path_factory.mktemp("quant")
    build_quantized_model("deepseek_v3", work / "model")
    write_conversations(work / "convs.jsonl", n=24)
    run_pipeline(
        "prepare", "--data", work / "convs.jsonl", "--model", work / "model", "--out", work / "prepared",
        "--seq-length", 128, "--draft-vocab-size", 128, check=True,
    )  # fmt: skip
    return work


def test_builder_writes_kimis_format(quant):
    """Every routed expert projection and only those is a packed triple; the rest stays bf16; the config is
    Kimi-K2's, and compressed-tensors reads it back; unpacking gives the weight back within a step."""
    from compressed_tensors.quantization import QuantizationConfig

    from pipeline.demo.quantized import compress_weight, dequantize_weight

    with safe_open(quant / "model" / "model.safetensors", "pt") as fh:
        names = set(fh.keys())
        packed = {n for n in names if n.endswith("weight_packed")}
        assert packed and all(".mlp.experts." in n and n.split(".")[-2] in ROUTED for n in packed)
        assert not any(".mlp.experts." in n and n.endswith(".weight") for n in names)
        for n in packed:
            base = n[: -len("weight_packed")]
            assert {base + "weight_scale", base + "weight_shape"} <= names
            assert (
                fh.get_slice(n).get_dtype() == "I32"
                and fh.get_slice(base + "weight_scale").get_dtype() == "BF16"
            )
        for n in names - packed:
            if n.endswith(".weight"):
                assert fh.get_slice(n).get_dtype() == "BF16", n
        assert "model.layers.1.mlp.shared_experts.up_proj.weight" in names and "lm_head.weight" in names
    config = json.loads((quant / "model" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"], weights["type"]) == (
        4,
        32,
        True,
        "int",
    )
    assert config["ignore"][0] == "lm_head" and "re:.*shared_experts.*" in config["ignore"]
    QuantizationConfig.model_validate(config)
    w = torch.randn(64, 128, dtype=torch.bfloat16)
    triple = compress_weight(w)
    back = dequantize_weight(triple).float()
    step = triple["weight_scale"].float().repeat_interleave(32, dim=1)
    err = (back - w.float()).abs() / step
    # rounding: half a step; the top of a symmetric group's range (max / 7.5, INT4 stops at +7) clips by up
    # to half a step more
    assert err.max() <= 1.01 and err.mean() <= 0.3, (err.max(), err.mean())


def test_kimi_wrapper_keeps_the_config_in_text_config(tmp_path):
    from pipeline.demo.quantized import build_quantized_model

    model = build_quantized_model("kimi_k25", tmp_path / "kimi")
    raw = json.loads((model / "config.json").read_text())
    assert (
        "quantization_config" not in raw
        and raw["text_config"]["quantization_config"]["format"] == "pack-quantized"
    )
    assert "re:.*vision_tower.*" in raw["text_config"]["quantization_config"]["ignore"]
    proc = run_pipeline("preflight", "--model", model, "--backend", "hf")
    line = next(ln for ln in proc.stdout.splitlines() if " quantization:" in ln)
    assert " ok " in line and "text_config.quantization_config" in line, proc.stdout


def test_preflight_says_what_it_found(quant):
    proc = run_pipeline(
        "preflight", "--model", quant / "model", "--prepared", quant / "prepared", "--backend", "hf"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if " quantization:" in ln)
    assert "compressed-tensors, pack-quantized, int4 weights, group 32, symmetric" in line
    assert "ok   layer count" in proc.stdout  # the index/header checks take weight_packed & co


def test_hf_without_compressed_tensors_is_refused_in_one_line(quant, tmp_path):
    """preflight, extract (before any model load, nothing written) and verify's recompute each refuse."""
    pre = run_without_ct("preflight", "--model", quant / "model", "--backend", "hf")
    assert (
        pre.returncode == 3
        and "fail quantization: the checkpoint is compressed-tensors-quantized" in pre.stdout
    )
    out = tmp_path / "states"
    ext = run_without_ct(
        "extract", "--prepared", quant / "prepared", "--model", quant / "model", "--out", out,
        "--backend", "hf",
    )  # fmt: skip
    assert ext.returncode != 0 and "Traceback" not in ext.stderr, ext.stderr
    assert (
        ext.stderr.strip()
        .splitlines()[-1]
        .startswith("error: the checkpoint is compressed-tensors-quantized")
    )
    assert not out.exists()


def test_weights_are_bit_exact(quant):
    run_pipeline("weights", "--model", quant / "model", "--out", quant / "verifier", check=True)
    with (
        safe_open(quant / "verifier" / "verifier.safetensors", "pt") as out,
        safe_open(quant / "model" / "model.safetensors", "pt") as src,
    ):
        pairs = {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "lm_head.weight": "lm_head.weight"}  # fmt: skip
        assert set(out.keys()) == set(pairs)
        for key, name in pairs.items():
            got, want = out.get_tensor(key), src.get_tensor(name)
            assert got.dtype == torch.bfloat16 and torch.equal(got, want), key


# extract --backend hf against an fp32 forward of the dequantized model, verify --model and train on the
# states: tests/bench/test_quant_gpu.py (bench/quant_gpu.py's tiny preset runs exactly that chain).


def test_the_dequantized_experts_are_candidates_for_vllm_s_fused_kernel(quant):
    """transformers dequantizes the packed INT4 experts into its own experts modules, which are laid out as
    vLLM's fused MoE kernel reads them: on a GPU the quantized target's hf path runs that kernel too."""
    from pipeline.backends import fused_experts
    from pipeline.backends.base import BackendOptions
    from pipeline.backends.hf import HFBackend
    from pipeline.model.modeldir import read_model_dir

    model = read_model_dir(quant / "model")
    b = HFBackend(BackendOptions(model=model, layer_ids=(0, 1), fused_experts=False))
    try:
        cfg = b.decoder.config
        names = [name for name, _ in fused_experts.candidates(b.decoder)]
        moe_layers = range(cfg.first_k_dense_replace, model.num_layers)
        assert names == [f"layers.{i}.mlp.experts" for i in moe_layers]
    finally:
        b.close()
