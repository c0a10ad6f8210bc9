"""Which extraction backend ``auto`` means: one rule for ``pipeline extract --backend auto`` and ops' layout.

The rule, from what was measured side by side on one H200 (docs/benchmarks.md, "2026-12-03 night"): on a
model whose weights fit one GPU the two loops now run level (llama-1b 1,024 conversations: vllm 193.5k
tok/s from warm caches, 145k cold, hf 196k; llama-8b 256: 35.5k / 34.0k against 35.2k), but hf reaches its
first batch 10-80 s sooner (1b: 24 s against 34 s warm and 111 s cold), so its whole process is the shorter
one (1b: 34 s against 45 s warm / 125 s cold). So hf where the weights fit one GPU (data parallel over the
GPUs: one process each), vLLM where they do not (tensor parallel over the GPUs: the reference Kimi-K2.5
target, ~595 GB on 96 GB cards, fits no single card).
Where vLLM is not installed the answer is hf; where the sizes are unknown (a dry run before the preflight)
the answer waits for them.

Owns only the decision and its one-line reason; the facts (weight bytes, GPU memory, whether vLLM is
installed) are gathered by each side: pipeline/backends/choice.py in the container, ops' preflight on the
host. Standard library only (contract/__init__.py).
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"
BACKENDS = ("hf", "vllm")
# The weights must fit in this share of one GPU's memory for the hf backend: the rest holds a batch's
# activations (32,768 tokens by default) and the CUDA context.
FIT_SHARE = 0.8
MEASURED = "hf's loop runs level with vLLM's there and starts 10-80 s sooner (H200, docs/benchmarks.md)"


@dataclass(frozen=True)
class Choice:
    backend: str
    reason: str


def choose(weights_bytes: int | None, gpu_memory_bytes: int | None, gpus: int, has_vllm: bool) -> Choice:
    """The backend ``auto`` resolves to, and why (pure)."""
    if gpus < 1:
        return Choice("hf", "no GPU visible (the vllm CPU build is for tests)")
    if not has_vllm:
        return Choice("hf", "vLLM is not installed")
    if weights_bytes is None or gpu_memory_bytes is None:
        return Choice("vllm", "the model's size or the GPU memory is unknown: vLLM shards it over the GPUs")
    gib = 2**30
    sizes = (
        f"weights {weights_bytes / gib:.1f} GiB, {FIT_SHARE:.0%} of one GPU {gpu_memory_bytes / gib:.1f} GiB"
    )
    if weights_bytes <= FIT_SHARE * gpu_memory_bytes:
        return Choice("hf", f"the model fits one GPU ({sizes}); {MEASURED}")
    return Choice("vllm", f"the model does not fit one GPU ({sizes}): vLLM runs it tensor parallel")


def weight_file(name: str) -> bool:
    """The files of a checkpoint folder that hold its weights (what ``weights_bytes`` sums)."""
    return name.endswith((".safetensors", ".bin", ".pt")) and not name.startswith(".")
