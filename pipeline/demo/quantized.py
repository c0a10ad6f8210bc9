"""Quantized test targets: the DeepSeek-V3 / Kimi-K2.5 layout with its routed experts stored as INT4.

The reference target (Kimi-K2.5) ships its routed experts as compressed-tensors INT4, pack-quantized,
group-wise (group 32, symmetric), and everything else (embeddings, MLA attention, the first dense layer's
MLP, shared experts, the router, norms, lm_head, the vision tower) in bf16. ``quantize_routed_experts``
rewrites a bf16 checkpoint written by ``pipeline.demo.tiny.build_tiny_model`` (or bench/gpu_models.py)
into that format with the ``compressed-tensors`` library's own API: the scales by
``calculate_qparams`` (min-max, symmetric), the packing by ``PackedQuantizationCompressor.compress``
(``weight`` -> ``weight_packed`` int32, ``weight_scale``, ``weight_shape``), the config by its
``QuantizationConfig`` model. No packer of ours.

What is mirrored, and from where (public sources, read through the search tool, 2026-12):

* the ``quantization_config`` of moonshotai/Kimi-K2-Thinking's config.json (as quoted field for field by
  a public re-quantization script that restores "Kimi K2's original format"): one config group
  ``group_0`` targeting ``Linear`` with weights ``num_bits 4, type int, strategy group, group_size 32,
  symmetric true, dynamic false, observer minmax, actorder null, block_structure null``, no activation
  quantization; ``format: pack-quantized``, ``quant_method: compressed-tensors``,
  ``quantization_status: compressed``, ``kv_cache_scheme: null``; ``ignore``: ``lm_head``,
  ``re:.*self_attn.*``, ``re:.*shared_experts.*``, ``re:.*mlp\\.(gate|up|gate_up|down)_proj.*`` (the
  dense layer's MLP), which leaves exactly the routed experts (the router ``mlp.gate`` is not a
  ``Linear`` in vLLM's or compressed-tensors' sense of the targets and is never quantized);
* where Kimi-K2.5 (and K2.6, same layout) keeps it: inside ``text_config`` of the wrapper's config.json
  (llm-compressor's Kimi-K2.6 example reads ``quant_config_key="text_config.quantization_config"``; an
  MLX port notes "Kimi stores quantization_config under text_config, not top-level"); vLLM 0.32 reads the
  top level first, then the text config (``model_arch_config_convertor.get_quantization_config``); for the
  wrapper we add ``re:.*vision_tower.*`` and ``re:.*mm_projector.*`` to ``ignore``, as Moonshot's later
  Kimi-K3 config publishes them (the K2.5 list itself we have not seen);
* the tensors: per routed expert projection ``weight_packed`` (int32, 8 values per word along the input
  dim), ``weight_scale`` (bf16, one per 32 inputs) and ``weight_shape`` ([out, in]); no zero point
  (symmetric), exactly what ``PackedQuantizationCompressor`` writes.

Not mirrored: the real checkpoint's scales come from quantization-aware training; ours are min-max of random
weights, which is all the stages can see of them.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

# Kimi-K2-Thinking's published quantization_config (see the module docstring for the source)
KIMI_K2_IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
]
KIMI_K25_EXTRA_IGNORE = ["re:.*vision_tower.*", "re:.*mm_projector.*"]
GROUP_SIZE = 32
# a routed expert's projection in the checkpoint (DeepSeek-V3 names; Kimi-K2.5's under language_model.)
ROUTED_EXPERT = re.compile(r"(^|\.)mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def _scheme(group_size: int):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=4,
        type="int",
        strategy="group",
        group_size=group_size,
        symmetric=True,
        dynamic=False,
        observer="minmax",
    )
    return QuantizationScheme(targets=["Linear"], weights=weights)


def quantization_config(*, wrapper: bool = False, group_size: int = GROUP_SIZE) -> dict:
    """The ``quantization_config`` a Kimi-K2-class checkpoint publishes, built by compressed-tensors'
    own ``QuantizationConfig`` (so every field it writes is one it reads back)."""
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(
        config_groups={"group_0": _scheme(group_size)},
        format="pack-quantized",
        quantization_status="compressed",
        ignore=KIMI_K2_IGNORE + (KIMI_K25_EXTRA_IGNORE if wrapper else []),
    )
    out = config.model_dump(mode="json")
    for key in ("global_compression_ratio", "sparsity_config", "transform_config"):
        out.pop(key, None)  # Kimi's config carries none of these
    return out


def compress_weight(weight, group_size: int = GROUP_SIZE) -> dict:
    """One ``Linear`` weight [out, in] as compressed-tensors pack-quantized INT4 (symmetric, group-wise):
    ``{"weight_packed", "weight_scale", "weight_shape"}``, by the library's min-max qparams and packer."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = _scheme(group_size)
    out_dim, in_dim = weight.shape
    if in_dim % group_size:
        raise ValueError(f"input dim {in_dim} is not a multiple of the group size {group_size}")
    grouped = weight.reshape(out_dim, in_dim // group_size, group_size)
    scale, zero_point = calculate_qparams(grouped.amin(dim=-1), grouped.amax(dim=-1), scheme.weights)
    state = {"weight": weight, "weight_scale": scale.to(weight.dtype), "weight_zero_point": zero_point}
    compressed = PackedQuantizationCompressor.compress(state, scheme)
    return {k: (v.to(torch.int64) if k == "weight_shape" else v).contiguous() for k, v in compressed.items()}


def dequantize_weight(compressed: dict, group_size: int = GROUP_SIZE):
    """The weight a pack-quantized tensor triple stands for (compressed-tensors' own decompress)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    return PackedQuantizationCompressor.decompress(dict(compressed), _scheme(group_size))["weight"]


def _shards(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    return [model_dir / "model.safetensors"]


def quantize_routed_experts(model_dir: Path, *, device: str = "cpu", group_size: int = GROUP_SIZE) -> dict:
    """Rewrite ``model_dir``'s routed experts (in place) as INT4 pack-quantized and write the
    ``quantization_config``; returns counts ``{"quantized": n, "kept": m, "bytes_before", "bytes_after"}``.

    A wrapper config (``text_config``, Kimi-K2.5) gets the config inside ``text_config``, where Kimi ships
    it. Call it on a staging copy: a shard is rewritten whole (temp name, then rename), but the folder is
    not consistent until the config and index are written too."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    counts = {"quantized": 0, "kept": 0, "bytes_before": 0, "bytes_after": 0}
    weight_map = {}
    for shard in _shards(model_dir):
        counts["bytes_before"] += shard.stat().st_size
        out = {}
        with safe_open(shard, "pt", device=device) as fh:
            for name in fh.keys():
                tensor = fh.get_tensor(name)
                if ROUTED_EXPERT.search(name):
                    base = name[: -len("weight")]
                    for key, value in compress_weight(tensor, group_size).items():
                        out[base + key] = value.cpu()
                    counts["quantized"] += 1
                else:
                    out[name] = tensor.cpu()
                    counts["kept"] += 1
        tmp = shard.with_name(shard.name + ".tmp")
        save_file(out, tmp, metadata={"format": "pt"})
        tmp.replace(shard)
        counts["bytes_after"] += shard.stat().st_size
        weight_map.update({name: shard.name for name in out})
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        raw = json.loads(index.read_text())
        raw["weight_map"] = dict(sorted(weight_map.items()))
        raw.setdefault("metadata", {})["total_size"] = counts["bytes_after"]
        index.write_text(json.dumps(raw, indent=2) + "\n")
    cfg_path = model_dir / "config.json"
    raw = json.loads(cfg_path.read_text())
    wrapper = isinstance(raw.get("text_config"), dict)
    (raw["text_config"] if wrapper else raw)["quantization_config"] = quantization_config(
        wrapper=wrapper, group_size=group_size
    )
    cfg_path.write_text(json.dumps(raw, indent=2) + "\n")
    return counts


def build_quantized_model(kind: str, out_dir: Path, *, seed: int = 0, **overrides) -> Path:
    """A tiny random ``kind`` (``deepseek_v3`` or ``kimi_k25``) target with INT4 routed experts: the bf16
    model of ``build_tiny_model`` rewritten by ``quantize_routed_experts``; ``out_dir`` appears whole or
    not at all."""
    from pipeline.demo.tiny import build_tiny_model

    if kind not in ("deepseek_v3", "kimi_k25"):
        raise ValueError(f"no quantized layout for {kind!r}: choose deepseek_v3 or kimi_k25")
    out_dir = Path(out_dir)
    staging = out_dir.with_name(out_dir.name + ".quant-staging")
    shutil.rmtree(staging, ignore_errors=True)
    build_tiny_model(kind, staging, seed=seed, **overrides)
    quantize_routed_experts(staging)
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir


def write_dequantized(model_dir: Path, out_dir: Path, *, device: str = "cpu") -> Path:
    """A copy of a quantized ``model_dir`` with every packed triple turned back into the ``weight`` it
    stands for (compressed-tensors' own decompress, on ``device``) and no ``quantization_config``: the
    reference an fp32 forward of "the dequantized model" loads without compressed-tensors."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    staging = out_dir.with_name(out_dir.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(model_dir, staging, ignore=shutil.ignore_patterns("*.safetensors"))
    for shard in _shards(model_dir):
        out = {}
        with safe_open(shard, "pt", device=device) as fh:
            names = list(fh.keys())
            for name in names:
                if name.endswith("weight_packed"):
                    base = name[: -len("weight_packed")]
                    triple = {
                        k: fh.get_tensor(base + k) for k in ("weight_packed", "weight_scale", "weight_shape")
                    }
                    out[base + "weight"] = dequantize_weight(triple).contiguous().cpu()
                elif (
                    not name.endswith(("weight_scale", "weight_shape"))
                    or base_of(name) + "weight_packed" not in names
                ):
                    out[name] = fh.get_tensor(name).cpu()
        save_file(out, staging / shard.name, metadata={"format": "pt"})
    index = staging / "model.safetensors.index.json"
    if index.exists():
        raw = json.loads(index.read_text())
        raw["weight_map"] = {
            (n[: -len("_packed")] if n.endswith("weight_packed") else n): f
            for n, f in raw["weight_map"].items()
            if not (
                n.endswith(("weight_scale", "weight_shape"))
                and base_of(n) + "weight_packed" in raw["weight_map"]
            )
        }
        index.write_text(json.dumps(raw, indent=2) + "\n")
    cfg_path = staging / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw.pop("quantization_config", None)
    if isinstance(raw.get("text_config"), dict):
        raw["text_config"].pop("quantization_config", None)
    cfg_path.write_text(json.dumps(raw, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir


def base_of(name: str) -> str:
    """``a.b.weight_scale`` -> ``a.b.`` (the module prefix of a compressed tensor's name)."""
    return name[: name.rindex(".") + 1]
