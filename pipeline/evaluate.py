"""The ``evaluate`` stage: is a trained draft worth serving? The target in vLLM with the draft (EAGLE-3, at
each k asked), against the same engine without speculation and with n-gram prompt lookup, on held-out
prompts: acceptance length and per-position acceptance (vLLM's counters), output tokens/s and time per
output token at batch 1 and in one batch of every prompt, and whether greedy outputs are equal.

Owns the stage: the prompts (a conversations file, each row cut before its last assistant turn and rendered
by the target's chat template with the generation prompt; rows of user turns alone are prompts as they
are), the methods' order, the output directory (``evaluate.json``, ``evaluate.md``, ``evaluate.png`` and each
engine's raw result and log under ``engines/``, all written to a staging folder and moved into place whole),
and the verdict line. The engines and their arithmetic are pipeline/specdec/.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import click

from pipeline.errors import StageError
from pipeline.ondisk import provenance
from pipeline.ondisk.atomic import write_json
from pipeline.ondisk.outdir import staged_dir
from pipeline.options import opt, options, validate
from pipeline.specdec import report
from pipeline.specdec.cache import ResultCache
from pipeline.specdec.measure import PHASES, Engine, Method, require_vllm, run_child


@dataclass(frozen=True)
class EvaluateConfig:
    model: Path = opt(help="Target model folder (what the draft was trained for).")
    draft: Path = opt(
        help="The trained draft: `pipeline train`'s output dir (its draft/) or the draft folder."
    )
    prompts: Path = opt(
        help="Held-out conversations (JSONL, as prepare reads; rows of user turns alone too)."
    )
    out: Path = opt(help="Output directory (evaluate.json, evaluate.md, evaluate.png, engines/).")
    k: tuple[int, ...] = opt(
        (1, 2, 3, 4, 5), help="Speculative tokens per step for the draft, one engine each."
    )
    ngram_k: tuple[int, ...] | None = opt(
        None, help="k values for n-gram prompt lookup (default: --k; 0: no n-gram engine)."
    )
    ngram_min: int = opt(2, low=1, high=64, help="n-gram lookup's prompt_lookup_min.")
    ngram_max: int = opt(5, low=1, high=64, help="n-gram lookup's prompt_lookup_max.")
    num_prompts: int = opt(64, low=1, high=100_000, help="Prompts used (the first N rows).")
    max_tokens: int = opt(256, low=2, high=1 << 20, help="Greedy tokens per answer at most.")
    batch: int = opt(
        0,
        low=0,
        high=1 << 20,
        help="Requests in the batched phase: the prompts repeated in order up to it, for a batch that fills "
        "the GPU (vLLM runs up to its max_num_seqs at once); 0: each prompt once.",
    )
    ignore_eos: bool = opt(False, help="Generate max_tokens for every prompt (the same work per method).")
    phases: str = opt(
        "batch1,batched",
        help="batch1 (one prompt at a time: TTFT, TPOT), batched (all "
        "prompts in one generate: tok/s of a loaded server), or both, comma-separated.",
    )
    max_model_len: int | None = opt(
        None, low=16, help="Engine context (default: longest prompt + max tokens)."
    )
    dtype: str = opt("auto", help="vLLM's dtype.")
    enforce_eager: bool = opt(False, help="No CUDA graphs (slower; what extraction uses).")
    batch_invariant: bool = opt(
        False,
        help="vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1, a CUDA GPU): greedy output no longer "
        "depends on how many tokens a step carries, so 'greedy equal' judges the draft, not kernel rounding "
        "(a MoE target's near-tie routing differs otherwise). Slower: its speeds are not a server's.",
    )
    gpu_memory_utilization: float | None = opt(None, low=0.01, high=1.0, help="vLLM's share of GPU memory.")
    tensor_parallel_size: int = opt(1, low=1, high=64, help="GPUs per engine (tensor parallel).")
    chat_template_kwargs: str | None = opt(
        None, help="JSON object for the chat template when rendering prompts."
    )
    trust_remote_code: bool = opt(False, help="Allow the tokenizer's own Python code (e.g. Kimi-K2.5).")
    timeout: float = opt(1800.0, low=10.0, help="Seconds one engine may take, start to exit.")
    overwrite: bool = opt(False, help="Replace an existing output directory.")
    bracket: bool = opt(
        True,
        decls="--no-bracket",
        help="Leave out the second no-speculation engine (by default it runs after the others: speed-ups are "
        "against the mean of both runs, and their drift says what engines of the same settings differ by).",
    )
    fresh: bool = opt(
        False,
        help="Start every engine again (default: reuse each engine's result an earlier run of the same "
        "target, draft, prompts and settings left, e.g. one that was killed).",
    )

    def __post_init__(self) -> None:
        validate(self)
        bad = sorted(set(self.phase_list()) - set(PHASES))
        if bad or not self.phase_list():
            raise StageError(f"--phases {self.phases!r}: choose from {', '.join(PHASES)} (comma-separated)")
        if self.ngram_min > self.ngram_max:
            raise StageError(f"--ngram-min {self.ngram_min} is above --ngram-max {self.ngram_max}")
        for flag, ks in (("--k", self.k), ("--ngram-k", () if self.ngram_k == (0,) else self.ngram_k or ())):
            if any(k < 1 or k > 32 for k in ks):
                raise StageError(f"{flag} {','.join(map(str, ks))}: each k must be 1..32")

    def phase_list(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.phases.split(",") if p.strip())


def draft_dir(path: Path) -> Path:
    """The draft folder vLLM loads: PATH/draft (a train output) or PATH itself."""
    for candidate in (path / "draft", path):
        if (candidate / "config.json").is_file():
            return candidate
    raise StageError(f"--draft {path}: no config.json in it or in its draft/: pass `pipeline train`'s --out")


def read_prompts(cfg: EvaluateConfig) -> list[list[int]]:
    """The token ids of each prompt: the row cut before its last assistant turn, rendered with the
    generation prompt by the target's chat template."""
    from pipeline.prepare import load_tokenizer, normalize_row, parse_line

    if not cfg.prompts.is_file():
        raise StageError(f"prompts file {cfg.prompts} not found (pass --prompts FILE.jsonl)")
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        raise StageError(f"{cfg.model} has no chat template: add chat_template.jinja to the model folder")
    kwargs = json.loads(cfg.chat_template_kwargs) if cfg.chat_template_kwargs else {}
    prompts = []
    with open(cfg.prompts, "rb") as fh:
        for line, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            if len(prompts) == cfg.num_prompts:
                break
            try:
                row = parse_line(raw)
                key = "messages" if isinstance(row, dict) and "messages" in row else "conversations"
                turns = row.get(key) if isinstance(row, dict) else None
                asks = isinstance(turns, list) and not any(
                    isinstance(t, dict) and str(t.get("role", t.get("from"))).lower() in ("assistant", "gpt")
                    for t in turns
                )
                if asks:  # a prompt row: an empty assistant turn lets the row be read as prepare reads one
                    row = {
                        key: [
                            *turns,
                            {"role": "assistant", "content": ""}
                            if key == "messages"
                            else {"from": "gpt", "value": ""},
                        ]
                    }
                messages = normalize_row(row)
            except ValueError as exc:
                raise StageError(f"{cfg.prompts}:{line}: {exc} (fix the row)") from None
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            if last == 0:
                raise StageError(f"{cfg.prompts}:{line}: the assistant turn has no prompt before it")
            text = tokenizer.apply_chat_template(
                messages[:last], tokenize=False, add_generation_prompt=True, **kwargs
            )
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not prompts:
        raise StageError(f"prompts file {cfg.prompts} has no rows: nothing to evaluate on")
    return prompts


def methods(cfg: EvaluateConfig, draft: Path) -> list[Method]:
    ks = () if cfg.ngram_k == (0,) else cfg.ngram_k or cfg.k
    ngram = [Method("ngram", k, ngram_min=cfg.ngram_min, ngram_max=cfg.ngram_max) for k in ks]
    again = [Method("none", again=True)] if cfg.bracket else []
    return [Method("none"), *ngram, *(Method("eagle3", k, draft=str(draft)) for k in cfg.k), *again]


def verdict(table: list[dict], drift: dict[str, float], batch_invariant: bool = False) -> str:
    """One line: the best draft k at batch 1 (or batched) against no speculation and the best n-gram, how
    far the no-speculation engine moved between its two runs (``drift``, where it ran twice), and greedy
    equality (where it failed without batch-invariant kernels, how to tell the draft from rounding)."""
    phase = "batch1" if any(r["phase"] == "batch1" for r in table) else "batched"
    rows = [r for r in table if r["phase"] == phase]
    eagle = max((r for r in rows if r["method"] == "eagle3"), key=lambda r: r["output_tokens_per_s"])
    ngram = max(
        (r for r in rows if r["method"] == "ngram"), key=lambda r: r["output_tokens_per_s"], default=None
    )
    text = (
        f"best draft {eagle['label']} ({phase}): acceptance length {eagle['acceptance_length'] or 1:.2f}, "
        f"{eagle['speedup']:.2f}x no speculation"
    )
    if eagle.get("decode_speedup"):
        text += f" ({eagle['decode_speedup']:.2f}x per output token after the first)"
    if ngram is not None:
        text += (
            f", {eagle['output_tokens_per_s'] / ngram['output_tokens_per_s']:.2f}x {ngram['label']} "
            f"(acceptance {ngram['acceptance_length'] or 1:.2f})"
        )
    if phase in drift:
        text += (
            f"; no speculation moved {100 * drift[phase]:.0f}% between its runs before and after "
            f"(speed-ups within that are noise)"
        )
    unequal = [r["label"] for r in table if not r["greedy_equal"]]
    if not unequal:
        return text + "; greedy output equal"
    text += f"; greedy output differs for {', '.join(unequal)}"
    if not batch_invariant:
        text += (
            " (vLLM's kernels are not batch-invariant: --batch-invariant tells a draft's fault from rounding)"
        )
    return text


def measured(
    keep: ResultCache, fresh: bool, engine: Engine, method: Method, prompts, engines: Path, log
) -> dict:
    """One method's result: the one an earlier run left under the same key (unless ``fresh``), else its
    engine's, kept for the next run as soon as the engine exited cleanly."""
    result = None if fresh else keep.get(method)
    if result is not None:
        result = {**result, "reused": True}
        write_json(engines / f"{method.slug}.json", result)
        log(
            f"evaluate: {method.label}: reused the result measured at {result.get('finished_at')} "
            "(--fresh measures it again)"
        )
    else:
        log(f"evaluate: {method.label} on {len(prompts)} prompts ...")
        result = run_child(engine, method, prompts, engines / f"{method.slug}.json")
        keep.put(method, result)
    for phase, r in result["phases"].items():
        log(f"  {phase}: {r['output_tokens_per_s']:,.1f} output tok/s")
    return result


def refuse_unservable(model: Path) -> None:
    """A target this vLLM cannot start an engine for here (an INT4-expert MoE on the CPU build), refused in
    one line before the first engine's start, as extract refuses it (pipeline/model/quantization.py)."""
    from contract.experts import experts_met
    from pipeline.model.quantization import read_quantization, vllm_refusal

    if not (model / "config.json").is_file():
        raise StageError(f"--model {model}: no config.json in it: pass the target model's folder")
    raw = json.loads((model / "config.json").read_text())
    refusal = vllm_refusal(raw, read_quantization(raw), experts_met(raw)[1], remedy="evaluate on a GPU")
    if refusal:
        raise StageError(refusal)


def run(cfg: EvaluateConfig, log=print) -> dict:
    require_vllm("run `pipeline evaluate` in the image (or .venv-vllm)")
    refuse_unservable(cfg.model)
    if cfg.batch_invariant:
        from pipeline.backends.base import visible_device_count

        if visible_device_count() == 0:
            raise StageError(
                "--batch-invariant: vLLM's batch-invariant kernels need a CUDA GPU and none is visible "
                "(the CPU build's engine dies in them): leave it off here, or evaluate on a GPU"
            )
    draft = draft_dir(cfg.draft)
    prompts = read_prompts(cfg)
    longest = max(len(p) for p in prompts)
    max_len = cfg.max_model_len or longest + cfg.max_tokens
    if longest + cfg.max_tokens > max_len:
        raise StageError(
            f"the longest prompt ({longest} tokens) + --max-tokens {cfg.max_tokens} exceeds "
            f"--max-model-len {max_len}: raise it, or lower --max-tokens"
        )
    engine = Engine(
        target=str(cfg.model),
        max_tokens=cfg.max_tokens,
        max_model_len=max_len,
        dtype=cfg.dtype,
        phases=cfg.phase_list(),
        enforce_eager=cfg.enforce_eager,
        ignore_eos=cfg.ignore_eos,
        batch=cfg.batch,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        tensor_parallel_size=cfg.tensor_parallel_size,
        timeout=cfg.timeout,
        batch_invariant=cfg.batch_invariant,
    )
    started = time.monotonic()
    with staged_dir(
        cfg.out,
        overwrite=cfg.overwrite,
        inputs={"--model": cfg.model, "--draft": cfg.draft, "--prompts": cfg.prompts},
    ) as staging:
        (staging / "engines").mkdir()
        plan = methods(cfg, draft)
        log(
            f"evaluate: {len(plan)} engines, each its own load of the target "
            f"({', '.join(m.label for m in plan)}); a result kept from an earlier run skips its load"
        )
        keep = ResultCache(cfg.out.with_name(f".{cfg.out.name}.engines"), engine, prompts)
        results = [
            measured(keep, cfg.fresh, engine, method, prompts, staging / "engines", log) for method in plan
        ]
        table = report.rows(results)
        moved = report.drift(results)
        line = verdict(table, moved, cfg.batch_invariant)
        summary = provenance.stamp(
            {
                "stage": "evaluate",
                "model": str(cfg.model.resolve()),
                "draft": str(draft.resolve()),
                "prompts": len(prompts),
                "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
                "engine": {k: v for k, v in engine.__dict__.items() if k != "env"},
                "rows": table,
                "none_drift": moved,
                "verdict": line,
                "wall_s": round(time.monotonic() - started, 1),
            },
            "evaluate",
        )
        write_json(staging / "evaluate.json", summary)
        (staging / "evaluate.md").write_text(report.markdown(table) + "\n" + line + "\n")
        report.plot(table, staging / "evaluate.png")
        write_json(staging / "summary.json", {k: v for k, v in summary.items() if k != "rows"})
    return summary


@click.command("evaluate")
@options(EvaluateConfig)
def command(**kwargs) -> None:
    """Measure a draft in vLLM: acceptance, decode speed, greedy equality vs. none and n-gram lookup."""
    summary = run(EvaluateConfig(**kwargs), log=lambda m: click.echo(m, err=True))
    click.echo(report.markdown(summary["rows"]))
    click.echo(summary["verdict"])
