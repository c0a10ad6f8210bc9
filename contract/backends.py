"""Which extraction backend ``auto`` means: one rule for ``pipeline extract --backend auto`` and ops' layout.

The rule, from what was measured side by side on one H200 (docs/benchmarks.md, "2026-12-04 12:00-12:55
UTC"): on a model whose weights fit one GPU vLLM's loop runs level with hf's from cold caches (llama-1b 1,024
conversations: 204k against 205k tok/s; llama-8b 256: 34.6k against 34.2k) and ahead from warm ones (237k,
37.1k: 1.16x, 1.08x, one run each), but hf reaches its first batch 7-13 s sooner (1b: 11 s against 18-21 s),
so its whole process is the shorter one at these sizes (1b: 20 s against 28-31 s). A warm vLLM's faster loop
would repay its start from ~6M (8b) to ~11M (1b) tokens; one sample per row is not enough to move the default
for that. So hf where the weights fit one GPU (data parallel over the GPUs: one process each), vLLM where they
do not (tensor parallel over the GPUs: the reference Kimi-K2.5 target, ~595 GB on 96 GB cards, fits no single
card).
Those figures are dense Llamas'. An MoE target that fits one GPU (a DeepSeek-V3 layout smaller than the
reference's) gets hf by the same rule, unmeasured against vLLM's fused MoE and MLA kernels, and its reason
says so (the experts as contract/experts.py reads them from config.json). The run that decides it, on one
GPU (not run yet: no GPU was lent on 2026-12-05): ``python -m bench.e2e_bench --shapes dsv3-9b --samples
384 --no-naive --also "vllm:--backend vllm" --also "vllmwarm@vllm:--backend vllm"``.
Where vLLM is not installed the answer is hf; where the sizes are unknown (a dry run before the preflight)
the answer waits for them.

Owns only the decision and its one-line reason; the facts (weight bytes, GPU memory, whether vLLM is
installed, the routed experts) are gathered by each side: pipeline/backends/choice.py in the container,
ops' preflight on the host. Standard library only (contract/__init__.py).
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"
BACKENDS = ("hf", "vllm")
# The weights must fit in this share of one GPU's memory for the hf backend: the rest holds a batch's
# activations (32,768 tokens by default) and the CUDA context.
FIT_SHARE = 0.8
MEASURED = "vLLM's loop is level with hf's there; hf starts 7-13 s sooner (H200, docs/benchmarks.md)"
UNMEASURED_MOE = (
    "those figures are dense models'; hf against vLLM's fused-MoE kernels on one GPU is unmeasured "
    '(docs/vllm.md, "Not verified here")'
)


@dataclass(frozen=True)
class Choice:
    backend: str
    reason: str


def choose(
    weights_bytes: int | None,
    gpu_memory_bytes: int | None,
    gpus: int,
    has_vllm: bool,
    experts: tuple[int, int] = (0, 0),
) -> Choice:
    """The backend ``auto`` resolves to, and why (pure). ``experts``: ``(k, E)`` of an MoE target
    (contract/experts.py), ``(0, 0)`` for a dense one."""
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
        k, routed = experts
        if routed:
            return Choice(
                "hf",
                f"the model fits one GPU ({sizes}); an MoE ({k} of {routed} experts per token): "
                + UNMEASURED_MOE,
            )
        return Choice("hf", f"the model fits one GPU ({sizes}); {MEASURED}")
    return Choice("vllm", f"the model does not fit one GPU ({sizes}): vLLM runs it tensor parallel")


def weight_file(name: str) -> bool:
    """The files of a checkpoint folder that hold its weights (what ``weights_bytes`` sums)."""
    return name.endswith((".safetensors", ".bin", ".pt")) and not name.startswith(".")
