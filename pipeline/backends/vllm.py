"""The vLLM backend: speculators' VllmHiddenStatesGenerator (0.4.0.1, with our patches) behind Backend.

Owns the generator's construction (the forced settings, tensor parallel size, CPU defaults for the KV
budget and thread binding), the check that the installed speculators/vLLM carry our patches, and the
validation of every result the generator returns: one result per input in input order, the same token
ids, exactly one [T, H] state per requested layer. The field bug "1 of 4 layers kept" and the ordering
bug class fail here, loudly, instead of writing wrong files. The extract loop (pipeline/extract.py) owns
batching, files, resume and progress; vLLM's own scheduler packs each batch into steps.

Process model: the generator spawns one worker process per tensor-parallel rank (vLLM's
MultiprocExecutor); this process keeps only the scheduler. Entry points must therefore be import-safe
(``if __name__ == "__main__":``), which ``python -m pipeline`` is.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from pipeline.backends.base import Backend, BackendOptions
from pipeline.errors import StageError

# The forced generator settings (DESIGN.md section 6); patch 0004 sets them and checks them after init.
FORCED_SETTINGS = {
    "enable_prefix_caching": False,
    "enable_chunked_prefill": False,
    "async_scheduling": False,
    "enforce_eager": True,
}
CPU_KVCACHE_GIB_DEFAULT = "1"  # VLLM_CPU_KVCACHE_SPACE when unset: vLLM's own default is half the RAM


def visible_device_count() -> int:
    """GPUs this process may use (CUDA_VISIBLE_DEVICES honoured); 0 without any. Counted through NVML
    where possible, so that this process creates no CUDA context before vLLM spawns its workers."""
    try:
        from vllm.utils.torch_utils import cuda_device_count_stateless
    except ImportError:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    return cuda_device_count_stateless()


def default_tensor_parallel_size() -> int:
    return max(1, visible_device_count())


def cpu_thread_binding(tensor_parallel_size: int, cpus: Sequence[int]) -> str:
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


def _cpu_environment(tensor_parallel_size: int) -> dict[str, str]:
    """Environment defaults for vLLM's CPU backend; an operator's own settings always win."""
    env = {}
    if "VLLM_MLA_DISABLE" not in os.environ:  # "MLA is not supported on CPU" (DeepSeek-V3/Kimi family)
        env["VLLM_MLA_DISABLE"] = "1"
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        env["VLLM_CPU_KVCACHE_SPACE"] = CPU_KVCACHE_GIB_DEFAULT
    if tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(tensor_parallel_size, sorted(os.sched_getaffinity(0)))
    return env


def check_patched() -> None:
    """Raise a one-line StageError unless speculators and vLLM carry our patches (cheap: no model load)."""
    from pipeline.preflight import installed_patch_checks

    failed = [c for c in installed_patch_checks() if c.failed]
    if failed:
        names = "; ".join(f"{c.name}: {c.detail}" for c in failed)
        raise StageError(f"the installed vLLM/speculators are not ready for extraction ({names}): run `python patches/apply.py`")


def _vllm_dtype(dtype: str) -> str:
    if dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise StageError(f"unknown --dtype {dtype!r}: choose auto, bfloat16, float16 or float32")
    return dtype


class VllmBackend(Backend):
    """A loaded vLLM model whose decoder-layer outputs are captured by speculators' worker extension."""

    name = "vllm"

    def __init__(self, options: BackendOptions):
        if options.device not in ("auto", "cuda") and not (options.device == "cpu" and visible_device_count() == 0):
            raise StageError(
                f"--device {options.device} is not supported by the vllm backend: it uses all visible devices "
                "(set CUDA_VISIBLE_DEVICES to choose them) and --tensor-parallel-size"
            )
        self.options = options
        self.tensor_parallel_size = options.tensor_parallel_size or default_tensor_parallel_size()
        if self.tensor_parallel_size < 1:
            raise StageError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        devices = visible_device_count()
        if devices and self.tensor_parallel_size > devices:
            raise StageError(
                f"--tensor-parallel-size {self.tensor_parallel_size} exceeds the {devices} visible GPU(s): "
                "lower it or make more devices visible"
            )
        if devices == 0:
            os.environ.update(_cpu_environment(self.tensor_parallel_size))
        check_patched()
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

        self.layer_ids = [int(k) for k in options.layer_ids]
        self._generator = VllmHiddenStatesGenerator(
            model_path=str(options.model.path),
            layer_ids=self.layer_ids,
            max_model_len=options.seq_length,
            tensor_parallel_size=self.tensor_parallel_size,
            max_num_batched_tokens=max(options.max_batch_tokens, options.seq_length),
            trust_remote_code=options.trust_remote_code,
            dtype=_vllm_dtype(options.dtype),
        )
        config = self._generator.vllm_config
        self._dtype = config.model_config.dtype
        self.settings = {
            "enable_prefix_caching": config.cache_config.enable_prefix_caching,
            "enable_chunked_prefill": config.scheduler_config.enable_chunked_prefill,
            "async_scheduling": config.scheduler_config.async_scheduling,
            "enforce_eager": config.model_config.enforce_eager,
            "block_size": config.cache_config.block_size,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
        }
        wrong = {k: self.settings[k] for k, v in FORCED_SETTINGS.items() if self.settings[k] != v}
        if wrong:
            self.close()
            raise StageError(f"vLLM did not take the forced extraction settings: {wrong} (expected {FORCED_SETTINGS})")

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def capture(self, batch: Sequence[Sequence[int]]) -> list[list[torch.Tensor]]:
        if not batch:
            return []
        seqs = [[int(t) for t in s] for s in batch]
        limit = self.options.seq_length - 1
        too_long = [i for i, s in enumerate(seqs) if len(s) > limit or not s]
        if too_long:
            i = too_long[0]
            raise StageError(
                f"sample {i} of the batch has {len(seqs[i])} tokens; the vllm backend takes 1..{limit} "
                "(seq_length - 1): re-run prepare with this --seq-length"
            )
        results = self._generator.generate(seqs)
        if len(results) != len(seqs):
            raise StageError(f"vLLM returned {len(results)} results for a batch of {len(seqs)}: requests were lost or duplicated")
        return [self._checked(i, seq, result) for i, (seq, result) in enumerate(zip(seqs, results, strict=True))]

    def _checked(self, i: int, seq: list[int], result: dict) -> list[torch.Tensor]:
        ids = result["input_ids"]
        if ids.tolist() != seq:
            raise StageError(
                f"vLLM result {i} belongs to another input (tokens differ): results out of input order; "
                "is speculators patch 0006-results-in-input-order applied? (python patches/apply.py --check)"
            )
        states = result["hidden_states"]
        if len(states) != len(self.layer_ids):
            raise StageError(
                f"vLLM returned {len(states)} hidden states for sample {i}, expected one per layer {self.layer_ids}"
            )
        hidden = self.options.model.hidden_size
        out = []
        for k, h in zip(self.layer_ids, states, strict=True):
            if tuple(h.shape) != (len(seq), hidden):
                raise StageError(f"vLLM state of layer {k} for sample {i} has shape {tuple(h.shape)}, expected ({len(seq)}, {hidden})")
            out.append(h.detach().to("cpu", copy=True).contiguous())
        return out

    def close(self) -> None:
        generator = getattr(self, "_generator", None)
        if generator is None:
            return
        self._generator = None
        executor = getattr(generator, "executor", None)
        if executor is not None:
            executor.shutdown()
            del generator.executor  # its __del__ would shut down again
