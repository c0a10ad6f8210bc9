"""A learned Llama target made to cost what a larger one costs per decoding step, answering the same.

A small target learned in minutes is host-bound at batch 1 in vLLM (docs/benchmarks.md, "Draft quality
and decode speed": a 169M target's forward is ~0.1 ms of an H100's bandwidth, vLLM's step 1.7-2.6 ms), so
a draft's decode speed-up on it measures vLLM's host work, not the draft. Training a target whose forward
bounds the step (several billion parameters) takes far longer than a benchmark has. This module pads the
learned one instead, with parameters that add exactly nothing to its residual stream:

- every MLP widened to ``intermediate_size``: the new rows of ``up_proj`` are zero (so the new activations
  are silu(gate) * 0 = 0), the new rows of ``gate_proj`` random (a real matmul), the new columns of
  ``down_proj`` zero;
- ``extra_layers`` more decoder layers after the learned ones, each a copy of the last learned layer with
  ``o_proj`` and ``down_proj`` zero: attention and MLP computed in full, their outputs 0 on the residual.

The learned layers keep their weights, the final norm, embeddings and lm_head are unchanged, so the padded
target computes the same function (up to the rounding of its wider matmuls), and a draft of the learned
target is a draft of it: the draft-value bench pads after the drafts are trained, and evaluate decodes the
padded one. What it is not: a larger model's *answers* (the text is the small target's).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def pad_target(src: Path, dst: Path, *, intermediate_size: int, extra_layers: int, seed: int = 0) -> dict:
    """Write the padded copy of the Llama target ``src`` to ``dst`` (temp name, then rename); its sizes."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    old_i, layers = config["intermediate_size"], config["num_hidden_layers"]
    if intermediate_size < old_i or extra_layers < 0:
        raise ValueError(
            f"padding only grows: intermediate {old_i} -> {intermediate_size}, +{extra_layers} layers"
        )
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(load_file(f))
    gen = torch.Generator().manual_seed(seed)

    def rows(w: torch.Tensor, n: int, random: bool) -> torch.Tensor:
        new = torch.zeros(n, w.shape[1], dtype=w.dtype)
        if random:
            new = (torch.randn(n, w.shape[1], generator=gen) * float(w.float().std())).to(w.dtype)
        return torch.cat([w, new])

    grow = intermediate_size - old_i
    for i in range(layers):
        p = f"model.layers.{i}.mlp."
        weights[p + "gate_proj.weight"] = rows(weights[p + "gate_proj.weight"], grow, True)
        weights[p + "up_proj.weight"] = rows(weights[p + "up_proj.weight"], grow, False)
        down = weights[p + "down_proj.weight"]
        weights[p + "down_proj.weight"] = torch.cat(
            [down, torch.zeros(down.shape[0], grow, dtype=down.dtype)], 1
        )
    last = f"model.layers.{layers - 1}."
    for j in range(layers, layers + extra_layers):
        for name in [k for k in list(weights) if k.startswith(last)]:
            tensor = weights[name].clone()
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensor.zero_()
            weights[f"model.layers.{j}." + name[len(last) :]] = tensor
    config.update(intermediate_size=intermediate_size, num_hidden_layers=layers + extra_layers)
    staging = dst.with_name(f".{dst.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy2(f, staging / f.name)
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(
        {k: v.contiguous() for k, v in weights.items()}, staging / "model.safetensors", {"format": "pt"}
    )
    shutil.rmtree(dst, ignore_errors=True)
    staging.rename(dst)
    return {
        "parameters": sum(v.numel() for v in weights.values()),
        "layers": layers + extra_layers,
        "learned_layers": layers,
        "intermediate_size": intermediate_size,
        "learned_intermediate_size": old_i,
    }
