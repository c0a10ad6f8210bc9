"""Online acceptance of a trained draft: vLLM serving the target with real EAGLE-3 speculative decoding.

Owns the measurement that the offline estimate (pipeline/train/evaluate.py) predicts. The held-out samples'
prompts (their tokens up to the first assistant token) are generated greedily twice, each run in its own
``python -m pipeline.train.online_eval`` process (vLLM spawns workers and keeps the device until exit): the
target alone, then the target with ``speculative_config={"model": DRAFT, "method": "eagle3",
"num_speculative_tokens": k}``. Reported: whether both runs produced the same tokens (speculative decoding
must not change greedy output) and vLLM's own spec-decode counters (``vllm:spec_decode_num_drafts``,
``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``), from which the mean acceptance length
is 1 + accepted / drafts, vLLM's definition. Where no GPU is visible the engine gets the CPU build's engine
arguments (pipeline/runtime/vllm_cpu.py); the CPU build's environment (``VLLM_CPU_KVCACHE_SPACE``) is the
caller's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from pipeline.ondisk.paths import LoopCheckedPath

from pipeline.ondisk.atomic import write_json
from pipeline.errors import StageError

SPEC_METRICS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


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


def acceptance_from_counters(counters: dict) -> dict:
    """vLLM's mean acceptance length (1 + accepted / drafts) and per-position acceptance rates."""
    drafts = int(counters.get("vllm:spec_decode_num_drafts", 0))
    accepted = int(counters.get("vllm:spec_decode_num_accepted_tokens", 0))
    per_pos = [int(x) for x in counters.get(PER_POS, [])]
    return {
        "acceptance_length": 1.0 + accepted / drafts if drafts else None,
        "per_position": [x / drafts for x in per_pos] if drafts else [],
        "drafts": drafts,
        "draft_tokens": int(counters.get("vllm:spec_decode_num_draft_tokens", 0)),
        "accepted_tokens": accepted,
    }


def _serve_once(cfg: OnlineConfig, prompts: list[list[int]], with_draft: bool) -> dict:
    """Generate in this process (the child): token ids per prompt and the spec-decode counters."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(
        model=str(cfg.target),
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        enforce_eager=True,
        disable_log_stats=False,
        enable_prefix_caching=False,
        seed=0,
    )
    if with_draft:
        kwargs["speculative_config"] = {
            "model": str(cfg.draft),
            "method": "eagle3",
            "num_speculative_tokens": cfg.k,
        }
    from pipeline.backends.base import visible_device_count

    if visible_device_count() == 0:
        from pipeline.runtime import vllm_cpu

        kwargs.update(vllm_cpu.engine_arguments(cfg.dtype))
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    counters: dict = {}
    for metric in llm.get_metrics():
        if metric.name in SPEC_METRICS:
            counters[metric.name] = counters.get(metric.name, 0) + int(metric.value)
        elif metric.name == PER_POS:
            counters[PER_POS] = [
                a + b
                for a, b in zip(counters.get(PER_POS, [0] * len(metric.values)), metric.values, strict=True)
            ]
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "counters": counters}


_ERROR_LINE = re.compile(r"\b(\w+(?:Error|Exception)): (.+)$")
_WRAPPERS = ("root cause", "stack trace", "EngineDeadError", "Engine core initialization failed")


def root_cause(output: str) -> str:
    """The line of a failed vLLM run that says why: the first ``SomeError: message`` that is not one of
    vLLM's wrappers pointing back at it ("see root cause above", EngineDeadError), without the log
    prefix; else the last line naming an error; else the last line."""
    lines = output.strip().splitlines() or ["no output"]
    found = [m for ln in lines if (m := _ERROR_LINE.search(ln))]
    cause = next((m for m in found if not any(w in m.group(0) for w in _WRAPPERS)), None)
    if cause is not None:
        return cause.group(0)
    return found[-1].group(0) if found else lines[-1]


def _child(cfg: OnlineConfig, prompts: list[list[int]], with_draft: bool, out: Path) -> dict:
    """One vLLM run in a fresh process; its result comes back through a JSON file."""
    request = out.with_suffix(".request.json")
    write_json(
        request,
        {
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in cfg.__dict__.items()},
            "prompts": prompts,
            "with_draft": with_draft,
        },
    )
    argv = [sys.executable, "-m", "pipeline.train.online_eval", "--request", str(request), "--out", str(out)]
    # its own session: vLLM's engine-core process outlives a killed parent and would hold our pipes open
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=cfg.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise StageError(
            f"vLLM did not finish within {cfg.timeout:.0f} s serving {cfg.target}: raise the timeout"
        ) from None
    except BaseException:  # Ctrl-C, or any other way out: leave no engine behind
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    with contextlib.suppress(ProcessLookupError):  # an engine process left after a normal exit
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0 or not out.is_file():
        what = "target + draft" if with_draft else "target alone"
        # both streams: vLLM's logger (the engine's traceback) writes to stdout, the child's own error to
        # stderr
        cause = root_cause(stderr + "\n" + stdout)
        raise StageError(f"vLLM failed serving the {what} (exit {proc.returncode}): {cause[:400]}")
    return json.loads(out.read_text())


def measure(cfg: OnlineConfig, prompts: list[list[int]], workdir: Path) -> dict:
    """Serve the target alone and with the draft on the same prompts; compare and read vLLM's counters."""
    try:
        from vllm import LLM  # noqa: F401
    except ImportError:
        raise StageError(
            "online acceptance needs vLLM in this environment (the image, or .venv-vllm): "
            "drop --online-eval or run where vLLM is installed"
        ) from None
    if not prompts:
        raise StageError(
            "no held-out sample has a prompt before its first assistant token: nothing to generate from"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    alone = _child(cfg, prompts, False, workdir / "target.json")
    spec = _child(cfg, prompts, True, workdir / "speculative.json")
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


@click.command()
@click.option("--request", type=LoopCheckedPath(exists=True), required=True)
@click.option("--out", type=LoopCheckedPath(), required=True)
def main(request: Path, out: Path) -> None:
    """Child process: one vLLM run described by --request, result to --out (internal)."""
    req = json.loads(request.read_text())
    raw = req["config"]
    cfg = OnlineConfig(**{**raw, "target": Path(raw["target"]), "draft": Path(raw["draft"])})
    write_json(out, _serve_once(cfg, req["prompts"], req["with_draft"]))


if __name__ == "__main__":
    main()
