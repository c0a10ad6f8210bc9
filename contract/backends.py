"""Which extraction backend ``auto`` means: one rule for ``pipeline extract --backend auto`` and ops' layout.

The rule, from what was measured side by side on one H200 (docs/benchmarks-history.md, "2026-12-04 12:00-12:55
UTC"): on a model whose weights fit one GPU vLLM's loop runs level with hf's from cold caches (llama-1b 1,024
conversations: 204k against 205k tok/s; llama-8b 256: 34.6k against 34.2k) and ahead from warm ones (237k,
37.1k: 1.16x, 1.08x, one run each), but hf reaches its first batch 7-13 s sooner (1b: 11 s against 18-21 s),
so its whole process is the shorter one at these sizes (1b: 20 s against 28-31 s). A warm vLLM's faster loop
would repay its start from ~6M (8b) to ~11M (1b) tokens; one sample per row is not enough to move the default
for that. So hf where the weights fit one GPU (data parallel over the GPUs: one process each), vLLM where they
do not (tensor parallel over the GPUs: the reference Kimi-K2.5 target, ~595 GB on 96 GB cards, fits no single
card).
Re-measured side by side on one H100 (docs/benchmarks.md, "Extraction against plain prefill", 2026-12-06):
vLLM's loop ran 1.08x hf's cold and 1.15x warm on llama-1b (1.59M tokens), 1.04x and 1.09x on llama-8b, and
hf reached its first batch 15-17 s sooner (1b: 11.6 s against 26.6-27.0 s), so vLLM's whole process is the
shorter one from ~25M (1b warm) to ~44M (1b cold) tokens, ~8-18M on 8b: a large set on one GPU would gain up
to ~8% with vLLM, while on several GPUs hf runs one process per GPU against vLLM's tensor parallelism, which
is unmeasured (it needs two GPUs). The rule stands until that run.
Those hf figures are its eager loop, while ``--compile auto`` compiles a dense model from 20.5M tokens (1b)
and 2.9M (8b), below the lengths where vLLM would pay. Measured on one H100 on 2026-12-07 (docs/benchmarks.md,
"The hf backend's dense loop compiled"), hf's compiled loop reaches an estimated ~0.89x (1b) and ~0.98x (8b)
of the engine's plain prefill, against vLLM's 0.90x and 0.94x warm: level on 1b, ahead on 8b, so the ~8% a
large set would have gained with vLLM is not there either.
Those figures are dense Llamas'. An MoE target (routed experts in config.json, as contract/experts.py reads
them) that fits one GPU goes to vLLM where the stage sees one GPU: on a DeepSeek-V3 layout of 9.3B parameters
(1.3B met per token; bench/gpu_models.py's dsv3-9b) on one H100 (docs/benchmarks-history.md, "2026-12-05
14:46-14:57 UTC"), vLLM's fused-MoE loop ran 1.2-1.5x hf's from cold caches (91k and 94k against 61k and 78k
tok/s; its Triton kernels compile inside the first batches) and 1.7-2.0x from warm ones (122k, 134k), while hf
reached its first batch 22-27 s sooner (28-32 s against 52-58 s). The warm loop repays that start from ~5M
tokens (~2,500 conversations of 2,048 tokens), less than any set a draft is trained on; hf's whole process is
the shorter one only for smaller runs (1.2M tokens: 44-48 s against 66-71 s). With several GPUs such a model
keeps hf, one process per GPU: vLLM would run it tensor parallel over all of them (ops' layout and
``pipeline extract``'s default), and that against hf's data parallelism is unmeasured (it needs two GPUs).
Re-measured side by side on one H100 on 2026-12-06 (docs/benchmarks.md, "Extraction against plain prefill";
1,024 conversations, 1.59M tokens): vLLM 148k tok/s warm and 134k cold against hf's 95k (1.56x, 1.41x), hf's
first batch 13-16 s sooner (17.4 s against 30.6-33.3 s): vLLM pays from ~4-5M tokens. The rule stands.
Those hf figures ran transformers' own experts. Since 2026-12-07 hf can run them through vLLM's fused MoE
kernel (pipeline/backends/fused_experts.py; on a GPU for runs of 13M tokens and more). Measured side by side
on one H100 on 2026-12-07 (docs/benchmarks.md, "The hf backend's MoE experts through vLLM's fused kernel";
dsv3-9b, 1.59M tokens): the fused hf loop ran 1.21x the unfused one (99k against 82k tok/s), and vLLM's
128k warm and 137k cold were still 1.30-1.51x the fused hf's 91-99k, while the kernel's start took hf's first
batch from 25.5 s to 53 s, past vLLM's 42-43 s. The rule stands.
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
MEASURED = (
    "vLLM's loop ran 1.04-1.15x hf's eager one there, hf starts 15-17 s sooner, and hf compiles from ~3-20M "
    "tokens, then level with or ahead of warm vLLM (H100, docs/benchmarks.md)"
)
MEASURED_MOE = (
    "vLLM's loop ran 1.3-1.5x hf's with hf's experts through vLLM's fused kernel (1.4-2.0x unfused), and "
    "starts 10 s sooner than the fused hf, 13-27 s later than the unfused: vLLM pays from ~4-5M tokens "
    "(H100, docs/benchmarks.md)"
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
    dequantized_extra: int = 0,
) -> Choice:
    """The backend ``auto`` resolves to, and why (pure). ``experts``: ``(k, E)`` of an MoE target
    (contract/experts.py), ``(0, 0)`` for a dense one. ``dequantized_extra``: what a quantized checkpoint's
    experts gain on the GPU when hf dequantizes them (contract/experts.py ``dequantized_extra_bytes``): hf
    must fit the weights as it holds them, vLLM as they are stored."""
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
    fits = weights_bytes <= FIT_SHARE * gpu_memory_bytes
    if fits and dequantized_extra and weights_bytes + dequantized_extra > FIT_SHARE * gpu_memory_bytes:
        held = (weights_bytes + dequantized_extra) / gib
        return Choice(
            "vllm",
            f"the quantized checkpoint fits one GPU as stored ({sizes}) but not as hf holds it, its experts "
            f"dequantized to bf16 ({held:.1f} GiB): vLLM runs its quantized kernels on them as stored",
        )
    if fits:
        k, routed = experts
        if routed and gpus == 1:
            return Choice(
                "vllm",
                f"the model fits one GPU ({sizes}) and is an MoE ({k} of {routed} experts per token): "
                + MEASURED_MOE,
            )
        if routed:
            return Choice(
                "hf",
                f"the model fits one GPU ({sizes}) and is an MoE ({k} of {routed} experts per token): "
                f"{MEASURED_MOE} on one GPU; on {gpus} GPUs vLLM's tensor parallelism against hf's process "
                "per GPU is unmeasured",
            )
        return Choice("hf", f"the model fits one GPU ({sizes}); {MEASURED}")
    return Choice("vllm", f"the model does not fit one GPU ({sizes}): vLLM runs it tensor parallel")


def weight_file(name: str) -> bool:
    """The files of a checkpoint folder that hold its weights (what ``weights_bytes`` sums)."""
    return name.endswith((".safetensors", ".bin", ".pt")) and not name.startswith(".")
