"""A target's checkpoint as its files' headers tell it, never a weight read: each safetensors file's JSON
header, the checkpoint's tensor names and which file holds each, and the MoE routing keys vLLM reads with
other defaults than transformers. The preflight stage and the vllm backend both check by it."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

from pipeline.checks import CheckResult, fail, ok
from pipeline.errors import StageError


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file: tensor names, dtypes, shapes. Reads a few KB, never the data."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise StageError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 * 1024 * 1024:
            raise StageError(f"{path} has an implausible header size {size}: not a safetensors file")
        header = json.loads(fh.read(size))
    header.pop("__metadata__", None)
    return header


def checkpoint_tensor_names(model_dir: Path) -> tuple[dict[str, str], str]:
    """Tensor name -> file name of the checkpoint, from the index or the single file's header."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"], index.name
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise StageError(f"{model_dir} has no *.safetensors files (nor model.safetensors.index.json)")
    names: dict[str, str] = {}
    for f in files:
        names.update(dict.fromkeys(safetensors_header(f), f.name))
    return names, ", ".join(f.name for f in files)


def check_moe_routing(names: dict[str, str], text: dict) -> Iterator[CheckResult]:
    """DeepSeek-V3-style routers: the config keys vLLM reads with defaults that differ from transformers'."""
    biases = any(n.endswith("e_score_correction_bias") for n in names)
    if not biases and text.get("model_type") != "deepseek_v3":
        return
    problems = []
    if biases and text.get("topk_method") != "noaux_tc":
        problems.append(
            "the checkpoint has e_score_correction_bias tensors "
            f"but topk_method is {text.get('topk_method')!r} "
            '(vLLM then fails on load with a KeyError): set "topk_method": "noaux_tc"'
        )
    if text.get("scoring_func", "softmax") != "sigmoid":
        problems.append(
            f"scoring_func is {text.get('scoring_func', '(missing)')!r}: vLLM then routes with softmax while "
            "transformers' DeepseekV3 and the checkpoint use sigmoid, silently changing every MoE layer: "
            'set "scoring_func": "sigmoid"'
        )
    if problems:
        yield fail("moe routing", "; ".join(problems))
    else:
        yield ok("moe routing", "noaux_tc top-k with sigmoid scoring, as transformers computes it")
