"""The facts ``--backend auto`` is decided on, read in the container: the checkpoint's weight bytes, the
smallest visible GPU's memory, the GPU count, whether vLLM is installed, an MoE's routed experts (its
config.json). The rule itself is contract/backends.py, shared with ops' layout, so a host run and a run by
hand choose alike.

GPU memory comes from NVML (nvidia-ml-py), not from torch: asking torch would create a CUDA context in
this process before vLLM starts its workers. Nothing here loads a model or imports vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from contract.backends import Choice, choose, weight_file
from contract.experts import dequantized_extra_bytes, experts_met
from pipeline.backends.base import visible_device_count


def weights_bytes(model_dir: Path) -> int | None:
    """Bytes of the checkpoint's weight files (a wrapper's too: the whole folder's top level)."""
    try:
        return sum(p.stat().st_size for p in model_dir.iterdir() if weight_file(p.name) and p.is_file())
    except OSError:
        return None


def _config(model_dir: Path) -> dict | None:
    """config.json, or None where it cannot be read (the stage's own checks name that)."""
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None


def model_experts(model_dir: Path) -> tuple[int, int]:
    """``(k, E)`` of the model's routed experts from its config.json; ``(0, 0)`` for a dense model, and for
    a config that cannot be read."""
    return experts_met(_config(model_dir))


def gpu_memory_bytes() -> int | None:
    """The smallest total memory among the visible GPUs (NVML; CUDA_VISIBLE_DEVICES as indices or UUIDs);
    None where NVML cannot tell."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            wanted = [v.strip() for v in visible.split(",") if v.strip()]
            handles = [h for i, h in enumerate(handles) if str(i) in wanted or _uuid(pynvml, h) in wanted]
        totals = [pynvml.nvmlDeviceGetMemoryInfo(h).total for h in handles]
        return min(totals) if totals else None
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def _uuid(pynvml, handle) -> str:
    uuid = pynvml.nvmlDeviceGetUUID(handle)
    return uuid.decode() if isinstance(uuid, bytes) else uuid


def resolve(requested: str, model_dir: Path) -> Choice:
    """``requested`` as given, or what ``auto`` means for this model on this machine."""
    if requested != "auto":
        return Choice(requested, "as asked")
    gpus = visible_device_count()
    return choose(
        weights_bytes(model_dir),
        gpu_memory_bytes() if gpus else None,
        gpus,
        importlib.util.find_spec("vllm") is not None,
        model_experts(model_dir),
        dequantized_extra_bytes(_config(model_dir)),
    )
