"""Online acceptance of a trained draft: vLLM serving the target with real EAGLE-3 speculative decoding.

The train stage's glue to the measurement that ``pipeline evaluate`` owns in full (pipeline/specdec/): the
held-out samples' prompts (their tokens up to the first assistant token) are generated greedily twice, each
engine in its own process, the target alone and then with ``speculative_config={"model": DRAFT, "method":
"eagle3", "num_speculative_tokens": k}``, all prompts in one batch, every answer ``max_tokens`` long.
Reported: whether both produced the same tokens (speculative decoding must not change greedy output) and
vLLM's own spec-decode counters, from which the mean acceptance length is 1 + accepted / drafts. Speed is
``pipeline evaluate``'s (batch 1 and batched, against n-gram lookup too).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import StageError
from pipeline.specdec.measure import (  # noqa: F401 - root_cause: this module's callers name it here
    Engine,
    Method,
    acceptance_from_counters,
    require_vllm,
    root_cause,
    run_child,
)


@dataclass(frozen=True)
class OnlineConfig:
    """What to serve and how much to generate."""

    target: Path  # the target model dir
    draft: Path  # the exported draft dir (OUT/draft)
    k: int = 3  # num_speculative_tokens
    max_tokens: int = 32  # greedy tokens generated per prompt
    max_model_len: int = 1024
    dtype: str = "auto"  # vLLM's dtype; float32 makes greedy equality exact on the CPU
    timeout: float = 900  # seconds per vLLM process


def prompts_of(files: list[Path], limit: int) -> list[list[int]]:
    """The prompt of each held-out sample: its tokens before the first assistant (loss_mask) token."""
    from pipeline.ondisk import formats

    prompts = []
    for path in files[:limit]:
        sample = formats.read_sample(path, mmap=True)
        mask = sample["loss_mask"].bool()
        first = int(mask.nonzero()[0, 0]) if bool(mask.any()) else int(mask.shape[0])
        if first > 0:
            prompts.append(sample["input_ids"][:first].tolist())
    return prompts


def measure(cfg: OnlineConfig, prompts: list[list[int]], workdir: Path) -> dict:
    """Serve the target alone and with the draft on the same prompts; compare and read vLLM's counters."""
    require_vllm("drop --online-eval or run where vLLM is installed")
    if not prompts:
        raise StageError(
            "no held-out sample has a prompt before its first assistant token: nothing to generate from"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    engine = Engine(
        target=str(cfg.target),
        max_tokens=cfg.max_tokens,
        max_model_len=cfg.max_model_len,
        dtype=cfg.dtype,
        phases=("batched",),
        enforce_eager=True,
        ignore_eos=True,
        timeout=cfg.timeout,
    )
    alone = run_child(engine, Method("none"), prompts, workdir / "target.json")["phases"]["batched"]
    draft = Method("eagle3", k=cfg.k, draft=str(cfg.draft))
    spec = run_child(engine, draft, prompts, workdir / "speculative.json")["phases"]["batched"]
    same = [a == b for a, b in zip(alone["tokens"], spec["tokens"], strict=True)]
    return {
        "k": cfg.k,
        "prompts": len(prompts),
        "max_tokens": cfg.max_tokens,
        "dtype": cfg.dtype,
        "greedy_equal": all(same),
        "greedy_equal_prompts": sum(same),
        **acceptance_from_counters(spec["counters"]),
    }
