"""Which extraction backend ``auto`` means: one rule for ``pipeline extract --backend auto`` and ops' layout.

The rule, branch by branch, with the run behind each (side by side on one H100; docs/benchmarks.md has the
current tables and their commands, docs/benchmarks-history.md every earlier run, on an H200 too):

- No GPU visible, or vLLM not installed: hf.
- A quantized checkpoint that fits one GPU as stored but not as hf holds it (its experts dequantized to bf16):
  vLLM, which runs its quantized kernels on the weights as stored.
- Weights that fit one GPU (``FIT_SHARE`` of its memory), a dense model: hf. vLLM's loop ran 1.08x hf's eager
  one cold and 1.15x warm on llama-1b (1.59M tokens), 1.04x and 1.09x on llama-8b, but hf reached its first
  batch 15-17 s sooner ("Extraction against plain prefill", 2026-12-06). From 20.5M tokens (1b) and 2.9M (8b)
  ``--compile auto`` compiles hf's loop, estimated at ~0.89x and ~0.98x of the engine's plain prefill against
  vLLM's 0.90x and 0.94x warm ("The hf backend's dense loop compiled", 2026-12-07): level or ahead.
- The same with an MoE (routed experts in config.json, contract/experts.py) and one GPU visible: vLLM. On
  dsv3-9b (bench/gpu_models.py; 9.3B parameters, 1.3B met per token) vLLM's loop ran 1.30-1.51x hf's with
  hf's experts through vLLM's fused kernel, and its first batch came 10 s sooner than the fused hf's ("The hf
  backend's MoE experts through vLLM's fused kernel", 2026-12-07); against transformers' own experts it ran
  1.4-2.0x (2026-12-05 and 2026-12-06), starting 13-27 s later, which it repays from ~4-5M tokens, less than
  any set a draft is trained on.
- The same MoE with several GPUs visible: hf, one process per GPU, which needs no communication between them.
  vLLM would run it tensor parallel over all of them; which is faster is unmeasured (a host of two GPUs
  settles it: docs/benchmarks.md, "Waiting for a GPU").
- Weights that do not fit one GPU (the reference Kimi-K2.5 target, ~595 GB on 96 GB cards), or sizes not
  known: vLLM, tensor parallel over the GPUs.

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
