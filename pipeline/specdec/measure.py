"""One vLLM engine per decoding method, each in its own process, on the same prompts: what each produced,
how fast, and vLLM's own spec-decode counters.

A method is ``none`` (the target alone), ``ngram`` (vLLM's prompt lookup, ``method: ngram``) or ``eagle3`` (a
draft folder), with ``k`` speculative tokens. Each engine generates greedily, with the same settings (eager
or not, no prefix caching, the same max_model_len and dtype), in up to two phases:

- ``batch1``: one prompt at a time. Per prompt, first ``max_tokens=1`` (its time to the first token, the
  prefill), then the whole answer; time per output token = (answer's wall - first token's wall) /
  (tokens - 1), the decode time a user of an idle server sees. The first prompt is asked once before the
  clock (CUDA graphs, caches), not counted.
- ``batched``: all prompts in one ``generate`` (vLLM batches up to its ``max_num_seqs``): output tokens/s
  of a loaded server; with ``batch`` set, the prompts repeated in order to that many requests (a batch that
  fills the GPU from fewer held-out prompts).

vLLM's counters (``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens``,
``..._num_accepted_tokens_per_pos``) are read before and after each phase, so each phase has its own
acceptance; the mean acceptance length is 1 + accepted / drafts, vLLM's definition. Greedy equality is
judged per phase against the ``none`` engine's tokens of the same phase (a batch of different size may
legitimately round differently). Where no GPU is visible the engine gets the CPU build's arguments
(pipeline/runtime/vllm_cpu.py); its speed figures then mean nothing, its acceptance and equality do.

vLLM's GPU kernels are not batch-invariant: a step that carries more tokens (a batch, or a speculative
step's k+1 positions) may round differently, and where logits are near ties (a MoE's routing, a random
model) greedy output then differs without any fault of the draft. Measured on an H100 on a random 9B
DeepSeek-V3 layout: the target alone gave 0/8 equal answers at batch 1 against batch 8, 8/8 with
``batch_invariant`` (vLLM's ``VLLM_BATCH_INVARIANT=1``, CUDA only; docs/benchmarks-raw/2026-12-06-quant/).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.errors import StageError
from pipeline.ondisk.atomic import write_json
from pipeline.runtime.vllm_log import root_cause

SPEC_METRICS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
PHASES = ("batch1", "batched")
METHODS = ("none", "ngram", "eagle3")


@dataclass(frozen=True)
class Method:
    """How the engine decodes: ``none``, ``ngram`` (prompt lookup of n-grams ``ngram_min``..``ngram_max``) or
    ``eagle3`` (``draft``), proposing ``k`` tokens per step."""

    name: str
    k: int = 0
    draft: str | None = None
    ngram_min: int = 2
    ngram_max: int = 5
    again: bool = False  # a second engine of the same method, after the others (evaluate's bracket)

    @property
    def label(self) -> str:
        return ("none" if self.name == "none" else f"{self.name} k={self.k}") + (
            " again" if self.again else ""
        )

    @property
    def slug(self) -> str:
        """The label as a file name: ``eagle3_k3``, ``none_again``."""
        return self.label.replace(" ", "_").replace("=", "")

    def speculative_config(self) -> dict | None:
        if self.name == "none":
            return None
        if self.name == "ngram":
            return {
                "method": "ngram",
                "num_speculative_tokens": self.k,
                "prompt_lookup_min": self.ngram_min,
                "prompt_lookup_max": self.ngram_max,
            }
        return {"method": "eagle3", "model": self.draft, "num_speculative_tokens": self.k}


@dataclass(frozen=True)
class Engine:
    """What every method's engine shares."""

    target: str
    max_tokens: int = 128
    max_model_len: int = 2048
    dtype: str = "auto"
    phases: tuple[str, ...] = PHASES
    enforce_eager: bool = False  # the CPU build is always eager
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = 1
    ignore_eos: bool = False  # True: every answer is max_tokens long (the same work for every method)
    batch: int = 0  # requests in the batched phase: the prompts repeated in order; 0: each prompt once
    timeout: float = 1800.0  # seconds per engine process
    batch_invariant: bool = False  # vLLM's batch-invariant kernels (CUDA): greedy equality judges the draft
    env: dict = field(default_factory=dict)

    def child_env(self) -> dict:
        """The environment of this engine's process: ours, ``env`` over it, and vLLM's switch for its
        batch-invariant kernels where asked."""
        return {**os.environ, **self.env, **({"VLLM_BATCH_INVARIANT": "1"} if self.batch_invariant else {})}


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


def _counters(llm) -> dict:
    counters: dict = {}
    for metric in llm.get_metrics():
        if metric.name in SPEC_METRICS:
            counters[metric.name] = counters.get(metric.name, 0) + int(metric.value)
        elif metric.name == PER_POS:
            old = counters.get(PER_POS, [0] * len(metric.values))
            counters[PER_POS] = [a + b for a, b in zip(old, metric.values, strict=True)]
    return counters


def _delta(after: dict, before: dict) -> dict:
    out = {k: after.get(k, 0) - before.get(k, 0) for k in SPEC_METRICS}
    if PER_POS in after:
        old = before.get(PER_POS, [0] * len(after[PER_POS]))
        out[PER_POS] = [a - b for a, b in zip(after[PER_POS], old, strict=True)]
    return out


def engine_kwargs(engine: Engine, method: Method) -> dict:
    """``vllm.LLM`` keyword arguments of one method's engine."""
    kwargs = dict(
        model=engine.target,
        dtype=engine.dtype,
        max_model_len=engine.max_model_len,
        enforce_eager=engine.enforce_eager,
        disable_log_stats=False,
        enable_prefix_caching=False,
        seed=0,
        tensor_parallel_size=engine.tensor_parallel_size,
    )
    if engine.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = engine.gpu_memory_utilization
    spec = method.speculative_config()
    if spec is not None:
        kwargs["speculative_config"] = spec
    from pipeline.backends.base import visible_device_count

    if visible_device_count() == 0:
        from pipeline.runtime import vllm_cpu

        kwargs.update(enforce_eager=True, **vllm_cpu.engine_arguments(engine.dtype))
    return kwargs


def _generate(llm, prompts, max_tokens: int, ignore_eos: bool) -> tuple[list[list[int]], float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start


def run_engine(engine: Engine, method: Method, prompts: list[list[int]]) -> dict:
    """In this process (the child): the method's engine over ``prompts``, phase by phase."""
    from vllm import LLM

    from pipeline.backends.base import visible_device_count

    if visible_device_count() == 0:  # the CPU build's defaults (a KV space, not 92% of RAM free at start)
        from pipeline.runtime import vllm_cpu

        os.environ.update(vllm_cpu.extraction_environment(engine.tensor_parallel_size))
    started = time.perf_counter()
    llm = LLM(**engine_kwargs(engine, method))
    result: dict = {"method": asdict(method), "engine_start_s": time.perf_counter() - started, "phases": {}}
    for phase in engine.phases:
        if phase == "batch1":
            _generate(llm, prompts[:1], engine.max_tokens, engine.ignore_eos)  # warm-up, not counted
            before = _counters(llm)
            tokens, first_s, whole_s = [], [], []
            for prompt in prompts:
                first_s.append(_generate(llm, [prompt], 1, True)[1])
                out, wall = _generate(llm, [prompt], engine.max_tokens, engine.ignore_eos)
                tokens += out
                whole_s.append(wall)
            counters = _delta(_counters(llm), before)
            n_out = sum(len(t) for t in tokens)
            decode_s = sum(w - f for w, f in zip(whole_s, first_s, strict=True))
            result["phases"][phase] = {
                "tokens": tokens,
                "counters": counters,
                "output_tokens": n_out,
                "wall_s": sum(whole_s),
                "output_tokens_per_s": n_out / sum(whole_s),
                "ttft_ms": 1000 * sum(first_s) / len(first_s),
                "tpot_ms": 1000 * decode_s / max(1, n_out - len(tokens)),
            }
        else:
            asked = [prompts[i % len(prompts)] for i in range(engine.batch)] if engine.batch else prompts
            before = _counters(llm)
            tokens, wall = _generate(llm, asked, engine.max_tokens, engine.ignore_eos)
            n_out = sum(len(t) for t in tokens)
            result["phases"][phase] = {
                "tokens": tokens,
                "counters": _delta(_counters(llm), before),
                "output_tokens": n_out,
                "wall_s": wall,
                "output_tokens_per_s": n_out / wall,
                "batch": len(asked),
            }
    result["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return result


def require_vllm(remedy: str) -> None:
    try:
        from vllm import LLM  # noqa: F401
    except ImportError:
        raise StageError(
            f"this measurement needs vLLM in this environment (the image, or .venv-vllm): {remedy}"
        ) from None


def run_child(engine: Engine, method: Method, prompts: list[list[int]], out: Path) -> dict:
    """One engine in a fresh process (vLLM keeps the device until its process exits); its result comes back
    through a JSON file. A failure is one line naming vLLM's root cause."""
    request = out.with_suffix(".request.json")
    write_json(request, {"engine": asdict(engine), "method": asdict(method), "prompts": prompts})
    argv = [sys.executable, "-m", "pipeline.specdec.measure", str(request), str(out)]
    log = out.with_suffix(".log")
    # its own session: vLLM's engine-core process outlives a killed parent and would hold our pipes open
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            argv,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=engine.child_env(),
            start_new_session=True,
        )
    try:
        proc.wait(timeout=engine.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise StageError(
            f"vLLM did not finish {method.label} within {engine.timeout:.0f} s: raise the timeout "
            f"(log: {log})"
        ) from None
    except BaseException:  # Ctrl-C, or any other way out: leave no engine behind
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    with contextlib.suppress(ProcessLookupError):  # an engine process left after a normal exit
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0 or not out.is_file():
        cause = root_cause(log.read_text(errors="replace"))
        raise StageError(
            f"vLLM failed serving {method.label} (exit {proc.returncode}): {cause[:400]} (log: {log})"
        )
    return json.loads(out.read_text())


def main(argv: list[str]) -> None:
    """The child: ``python -m pipeline.specdec.measure REQUEST OUT``."""
    req = json.loads(Path(argv[0]).read_text())
    engine = Engine(**{**req["engine"], "phases": tuple(req["engine"]["phases"])})
    write_json(Path(argv[1]), run_engine(engine, Method(**req["method"]), req["prompts"]))


if __name__ == "__main__":
    main(sys.argv[1:])
