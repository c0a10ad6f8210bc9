"""contract/backends.py: what `--backend auto` means, the one rule of pipeline extract and ops' layout."""

from __future__ import annotations

from contract.backends import FIT_SHARE, choose

GIB = 2**30
H200 = 141 * GIB


def test_a_model_that_fits_one_gpu_runs_on_hf():
    """Weights within FIT_SHARE of one GPU: hf, whose loop measured faster; the reason says both sizes."""
    c = choose(int(2.5 * GIB), H200, 8, True)
    assert c.backend == "hf"
    assert "fits one GPU" in c.reason and "2.5 GiB" in c.reason and "141.0 GiB" in c.reason


def test_a_model_larger_than_one_gpu_runs_on_vllm():
    """Kimi-K2.5's ~595 GB on 96 GB cards: vLLM, tensor parallel."""
    c = choose(595 * 10**9, 96 * GIB, 8, True)
    assert c.backend == "vllm" and "does not fit one GPU" in c.reason


def test_the_border_is_the_fit_share():
    """Exactly FIT_SHARE of the GPU fits; one byte more does not."""
    border = int(FIT_SHARE * H200)
    assert choose(border, H200, 1, True).backend == "hf"
    assert choose(border + 1, H200, 1, True).backend == "vllm"


def test_without_vllm_or_without_gpus_the_answer_is_hf():
    """No vLLM: hf even for a model too big for one GPU (it then fails in its own load); no GPU: hf."""
    assert choose(600 * GIB, 96 * GIB, 8, False).backend == "hf"
    assert choose(600 * GIB, None, 0, True).backend == "hf"


def test_an_moe_that_fits_one_gpu_runs_on_vllm_where_the_stage_sees_one_gpu():
    """One GPU: an MoE that fits goes to vLLM (its loop measured 1.3-1.5x hf's fused one), with the figures;
    several GPUs: hf, one process per GPU, the reason saying what is unmeasured; a dense model of the same
    size keeps hf; an MoE that does not fit gets vLLM, tensor parallel."""
    one = choose(18 * GIB, H200, 1, True, experts=(6, 64))
    assert one.backend == "vllm"
    assert "an MoE (6 of 64 experts per token)" in one.reason and "1.3-1.5x" in one.reason
    eight = choose(18 * GIB, H200, 8, True, experts=(6, 64))
    assert eight.backend == "hf" and "on 8 GPUs" in eight.reason and "unmeasured" in eight.reason
    assert choose(18 * GIB, H200, 1, True).backend == "hf"  # dense: the measured line
    big = choose(595 * 10**9, 96 * GIB, 8, True, experts=(8, 384))
    assert big.backend == "vllm" and "does not fit one GPU" in big.reason
    assert choose(18 * GIB, H200, 1, False, experts=(6, 64)).backend == "hf"  # no vLLM in the image


def test_unknown_sizes_shard_with_vllm():
    """A size that cannot be read (no weight files listed, NVML absent) does not guess 'fits'."""
    assert choose(None, H200, 8, True).backend == "vllm"
    assert choose(10 * GIB, None, 8, True).backend == "vllm"


def test_the_container_side_reads_the_weight_bytes_and_resolves_auto(tiny_llama):
    """pipeline/backends/choice.py sums the checkpoint's weight files (not its tokenizer or config) and, on a
    machine without GPUs, resolves auto to hf; an explicit backend is kept as asked."""
    from pipeline.backends.choice import resolve, weights_bytes

    assert weights_bytes(tiny_llama) == (tiny_llama / "model.safetensors").stat().st_size
    assert resolve("auto", tiny_llama).backend == "hf"
    assert resolve("auto", tiny_llama).reason.startswith("no GPU visible")
    assert resolve("vllm", tiny_llama).backend == "vllm"


def test_the_container_side_reads_the_experts_from_config_json(tmp_path, tiny_llama, tiny_deepseek):
    """The tiny DeepSeek's config: 2 of 8 routed experts a token; a Llama's: dense; a wrapper's text_config
    is looked into; an unreadable config.json counts as dense (the stage's own checks name it)."""
    import json

    from pipeline.backends.choice import model_experts

    assert model_experts(tiny_deepseek) == (2, 8)
    assert model_experts(tiny_llama) == (0, 0)
    wrapper = tmp_path / "wrapper"
    wrapper.mkdir()
    text = json.loads((tiny_deepseek / "config.json").read_text())
    (wrapper / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": text}))
    assert model_experts(wrapper) == (2, 8)
    (wrapper / "config.json").write_text("{not json")
    assert model_experts(wrapper) == (0, 0)
    assert model_experts(tmp_path / "missing") == (0, 0)


def test_extract_says_what_auto_chose_on_stdout_and_keeps_stderr_clean(tmp_path, tiny_llama, prepared_llama):
    """`pipeline extract` without --backend resolves auto, names its choice and why on stdout beside the
    closing line, and writes nothing on stderr (where a failure's one `error:` line goes)."""
    from pipeline.ondisk import formats
    from tests.conftest import run_pipeline

    out = tmp_path / "states"
    args = ("--prepared", prepared_llama, "--model", tiny_llama, "--out", out, "--limit", 2, "--no-progress")
    res = run_pipeline("extract", *args, check=True)
    assert "extract: --backend auto chose backend hf: no GPU visible" in res.stdout
    assert res.stderr.strip() == ""
    assert formats.read_data_config(out).backend == "hf"


KIMI_K2_TEXT = {  # Kimi-K2's text model as its config.json gives it, with its INT4 quantization_config
    "hidden_size": 7168,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 1,
    "n_routed_experts": 384,
    "num_experts_per_tok": 8,
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32, "type": "int"}}
        },
    },
}


def test_a_quantized_checkpoint_is_weighed_as_hf_would_hold_it():
    """INT4 experts (group 32) gain 2 - 0.5 - 2/32 bytes per parameter when hf dequantizes them: Kimi-K2's
    1.01T routed-expert parameters gain 1.46 TB. A checkpoint that fits one GPU as stored but not as hf holds
    it goes to vLLM (its kernels run the experts as stored), with both sizes in the reason; unquantized,
    the same bytes stay hf."""
    from contract.experts import dequantized_extra_bytes

    params = 384 * 60 * 3 * 7168 * 2048
    assert dequantized_extra_bytes({"text_config": KIMI_K2_TEXT}) == int(params * (2 - 0.5 - 2 / 32))
    plain = {k: v for k, v in KIMI_K2_TEXT.items() if k != "quantization_config"}
    assert dequantized_extra_bytes(plain) == 0 and dequantized_extra_bytes(None) == 0
    c = choose(60 * GIB, H200, 2, True, (8, 384), 80 * GIB)
    assert c.backend == "vllm" and "as stored" in c.reason and "140.0 GiB" in c.reason, c.reason
    assert choose(60 * GIB, H200, 2, True, (8, 384), 0).backend == "hf"
    assert choose(60 * GIB, H200, 2, True, (8, 384), 40 * GIB).backend == "hf"  # 100 GiB still fits


def test_the_estimate_matches_a_real_int4_checkpoint(tmp_path):
    """On the tiny INT4 DeepSeek-V3 layout that compressed-tensors writes (pipeline/demo/quantized.py), the
    estimate from config.json equals the bf16 bytes of its routed experts less what they take packed
    (weight_packed + weight_scale), within 1% (weight_shape's few bytes)."""
    import json

    from safetensors import safe_open

    from contract.experts import dequantized_extra_bytes
    from pipeline.demo.quantized import build_quantized_model

    model = build_quantized_model("deepseek_v3", tmp_path / "model")
    bf16 = stored = 0
    for shard in model.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                if ".experts." not in name or "shared" in name:
                    continue
                t = f.get_tensor(name)
                stored += t.numel() * t.element_size() if not name.endswith("weight_shape") else 0
                if name.endswith("weight_shape"):
                    bf16 += int(t.prod()) * 2
    estimate = dequantized_extra_bytes(json.loads((model / "config.json").read_text()))
    assert bf16 > 0 and abs(estimate - (bf16 - stored)) <= 0.01 * (bf16 - stored), (estimate, bf16, stored)
