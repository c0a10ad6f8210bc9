"""How much of a GPU's memory the vllm states producer may take when the trainer runs on one of its GPUs.

vLLM sizes its engine by ``gpu_memory_utilization`` (0.92 by default here): the weights, a profile run's
activations, and a KV cache in whatever is left of that share. Beside a trainer on the same GPU that default
leaves the trainer 8% of the card, and vLLM refuses to start at all when the trainer took more than that
first. So a producer that shares a GPU with the trainer gets a share of its own: as asked
(``--states-memory-share``), or by the rule below. An extraction step's requests end after one token, so the
KV cache needs room for about one step's tokens, not the long sequences serving fills it with.

Owns the rule and its one-line reason (pure: the facts come from pipeline/backends/choice.py and the run's
flags).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import StageError

# Beyond the weights on each GPU: the profile run's activations for a step of --states-max-batch-tokens
# tokens, the KV cache and the hidden-state buffers of a step's requests, the CUDA context.
HEADROOM = 0.2
LOWEST, HIGHEST = 0.3, 0.85  # the auto share's bounds: enough for a small model's engine; the trainer's rest
UNKNOWN = 0.5  # the auto share where the weights' size or the GPU's memory is not known


@dataclass(frozen=True)
class Share:
    value: float | None  # vLLM's gpu_memory_utilization; None: vLLM's default
    reason: str


def check_share(share: float | None, backend: str | None = None) -> None:
    """``--states-memory-share`` is a fraction strictly between 0 and 1, for a vllm producer: refused in one
    line for a ``backend`` known to be another (None: not resolved yet, auto before the model is read)."""
    if share is None:
        return
    if not 0 < share < 1:
        raise StageError(
            f"--states-memory-share {share:g} must be between 0 and 1 (exclusive): the vllm producer's share "
            "of each of its GPUs' memory, e.g. 0.5"
        )
    if backend is not None and backend != "vllm":
        raise StageError(
            f"--states-memory-share {share:g} is the vllm producer's share of GPU memory, and the {backend} "
            "backend produces here: drop it, or pass --states-backend vllm"
        )


def producer_share(
    asked: float | None,
    backend: str,
    trainer_gpu: int | None,
    engine_gpus: int,
    weights_bytes: int | None,
    gpu_memory_bytes: int | None,
) -> Share:
    """The vllm producer's memory share. ``trainer_gpu``: the trainer's CUDA index (None off CUDA);
    ``engine_gpus``: the engine spans GPUs 0..engine_gpus-1 (tensor parallel)."""
    check_share(asked, backend)
    if backend != "vllm":
        return Share(None, f"the {backend} producer takes what its model and batches need")
    if asked is not None:
        return Share(asked, "as asked")
    if trainer_gpu is None or trainer_gpu >= engine_gpus:
        return Share(None, "vLLM's default: the trainer has no GPU of the engine's")
    if weights_bytes is None or gpu_memory_bytes is None:
        return Share(UNKNOWN, f"shared with the trainer on GPU {trainer_gpu}; the model's size is unknown")
    per_gpu = weights_bytes / engine_gpus / gpu_memory_bytes
    value = round(min(HIGHEST, max(LOWEST, per_gpu + HEADROOM)), 2)
    return Share(
        value,
        f"shared with the trainer on GPU {trainer_gpu}: weights {per_gpu:.0%} of each GPU + {HEADROOM:.0%} "
        f"headroom, within [{LOWEST}, {HIGHEST}]",
    )
