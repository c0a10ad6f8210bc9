"""The benchmark's target models: random-weight Llama shapes built straight on the GPU and saved as
checkpoints.

Building an 8B model on the CPU takes minutes (every weight initialised there); on the GPU it takes seconds.
The norms' weights are drawn around 1, as pipeline/demo/tiny.py draws them, so no layer is an identity.
"""

from __future__ import annotations

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


def build_model(shape: str, device: str = "cuda", seed: int = 0) -> torch.nn.Module:
    """A random Llama (bf16 on a GPU, fp32 on the CPU) of ``shape`` on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        **SHAPES[shape],
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=5,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16 if device != "cpu" else torch.float32
        )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.5 * torch.randn_like(param, dtype=torch.float32))
    return model.eval()


def save_model(model: torch.nn.Module, out: Path) -> Path:
    """Save as safetensors under ``out`` (a staging name first, renamed when complete)."""
    staging = out.with_name(out.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out
