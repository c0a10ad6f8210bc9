"""The benchmark's target models: random-weight shapes built straight on the GPU and saved as checkpoints.

Dense Llama shapes (``SHAPES``), and in ``MOE_SHAPES`` the DeepSeek-V3 layout of Kimi-K2.5, the reference
target (MLA attention, a first dense layer, then shared + routed experts with sigmoid routing): the family
whose default extraction backend contract/backends.py must also get right. Building an 8B model on the CPU
takes minutes (every weight initialised there); on the GPU it takes seconds. The norms' weights are drawn
around 1, as pipeline/demo/tiny.py draws them, so no layer is an identity; an MoE shape's routing bias too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


SHAPES = {
    "tiny": dict(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),  # the smoke tests' size (CPU)
    # ~1.5B parameters, 0.97B of them in the decoder
    "llama-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
    ),
    # the Llama-3-8B shape: hidden 4096, 32 layers, 32 heads, GQA 8
    "llama-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
}

# DeepSeek-V3's layout (pipeline/demo/tiny.py ``deepseek_config``: its MLA head sizes, Kimi-K2.5's one routing
# group) at sizes that fit one GPU, so that the hf backend, which the rule gives such a model, can run it
MOE_SHAPES = {
    "dsv3-tiny": dict(),  # the smoke tests' size (CPU): the tiny layout as it is (8 layers)
    # ~9.3B parameters (18.7 GB in bf16), ~1.3B of them met by each token: hidden 2048, 16 layers (the
    # first dense), 64 routed experts of 1,408 (6 per token) + 2 shared, vocab 129,280
    "dsv3-9b": dict(
        vocab_size=129280,
        hidden_size=2048,
        intermediate_size=8192,
        moe_intermediate_size=1408,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=768,
        n_shared_experts=2,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
    ),
}


def model_config(shape: str):
    """The transformers config of ``shape`` (a Llama of SHAPES or a DeepSeek-V3 layout of MOE_SHAPES)."""
    from transformers import LlamaConfig

    from pipeline.demo.tiny import VOCAB_SIZE, deepseek_config

    if shape in MOE_SHAPES:
        overrides = dict(MOE_SHAPES[shape])
        return deepseek_config(overrides.pop("vocab_size", VOCAB_SIZE), **overrides)
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}: choose one of {', '.join([*SHAPES, *MOE_SHAPES])}")
    return LlamaConfig(
        **SHAPES[shape],
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=5,
        pad_token_id=0,
    )


def build_model(shape: str, device: str = "cuda", seed: int = 0) -> torch.nn.Module:
    """A random model (bf16 on a GPU, fp32 on the CPU) of ``shape`` on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    config = model_config(shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16 if device != "cpu" else torch.float32
        )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.5 * torch.randn_like(param, dtype=torch.float32))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # routing's bias: the noaux_tc path exercised
                buffer.copy_(0.01 * torch.randn_like(buffer, dtype=torch.float32))
    return model.eval()


def save_model(model: torch.nn.Module, out: Path) -> Path:
    """Save as safetensors under ``out`` (a staging name first, renamed when complete); a DeepSeek-V3
    layout's config spells out its routing for vLLM, as pipeline/demo/tiny.py's checkpoints do."""
    from pipeline.demo.tiny import spell_out_routing

    staging = out.with_name(out.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    if model.config.model_type == "deepseek_v3":
        config = json.loads((staging / "config.json").read_text())
        spell_out_routing(config)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out
