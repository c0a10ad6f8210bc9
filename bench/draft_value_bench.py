"""Benchmark: is the draft worth serving? (issue #48 item 4) A learned target that answers in prose, its
answers regenerated through its own `vllm serve` by `pipeline regenerate`, a draft trained on them by our own
stages, then `pipeline evaluate`: acceptance and decode speed in vLLM against no speculation and n-gram
lookup; beside it the same draft recipe on the original answers, to show what regeneration buys.

The target (pipeline/demo/learned.py) is a Llama trained in process on docstring question-and-answer
conversations (`docstring_rows`: "What does `f(x)` in `m` do?" -> its docstring; prose, not code
continuation) from the installed packages. The rows are split three ways, seeded: the target's training
rows, the draft's rows (held apart from the target, so its answers to them are its own words, not
recitations) and the held-out evaluation prompts. Every stage runs through its real command line, each its
own process:

    target -> vllm serve target -> pipeline regenerate (through the server) -> stop server
    -> for each of regenerated, original: prepare -> extract (hf) -> [weights] -> train
    -> pipeline evaluate (regenerated draft at k = 1..5; original draft at k = 3)

Phases (`--phases`, comma-separated, default all) share `--work`, so a run can be cut into calls on one warm
machine: `build` (target, serve, regenerate, both drafts) then `evaluate`. Every figure goes to `--json`
after each phase. On one H100 (the two calls, each under 10 minutes):

    python -m bench.draft_value_bench --preset gpu --phases build --work /tmp/dv --json $OUT/dv.json
    python -m bench.draft_value_bench --preset gpu --phases evaluate --work /tmp/dv --json $OUT/dv.json

`--preset tiny` runs the same chain on the CPU build in minutes (its figures mean nothing; the smoke test).
`--preset gpu-padded` (and `tiny-padded`) pads the learned target with parameters that add nothing
(bench/padded_target.py) before the drafts are evaluated (the `pad` step, first of `evaluate`), so that a
decoding step costs what a 5.1B model's does: the batch-1 speed-up then measures the draft, not vLLM's host
work. Regenerate and the drafts run on the learned target, whose function the padded one computes:
    python -m bench.draft_value_bench --preset gpu-padded --phases target,regenerate,regen-draft ...
    python -m bench.draft_value_bench --preset gpu-padded --phases pad,eval-regen ...
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

import click

GOALS = {"acceptance_vs_ngram_k3": 1.2, "batch1_vs_none": 2.0, "batch1_vs_ngram": 1.2}


@dataclasses.dataclass(frozen=True)
class Preset:
    max_chars: int  # corpus cap (pipeline/demo/learned.py corpus "installed")
    model: dict  # LlamaConfig overrides
    vocab_size: int
    target_seconds: float
    target_seq: int
    target_batch: int
    target_lr: float
    draft_rows: int  # conversations the draft learns from
    eval_prompts: int
    max_tokens: int  # regenerate's and evaluate's answer length
    concurrency: int
    seq_length: int  # prepare --seq-length
    draft_vocab: int
    epochs: int
    lr: float
    k: str  # evaluate --k for the regenerated draft
    device: str
    serve_args: tuple[str, ...] = ()
    eval_args: tuple[str, ...] = ()
    regen_max_tokens: int = 512  # regenerate's --max-tokens: a docstring answer runs to ~400 tokens
    regen_args: tuple[str, ...] = ()  # more regenerate flags (the tiny target samples: greedy never stops)
    # (intermediate_size, extra layers): the learned target padded with parameters that add nothing
    # (bench/padded_target.py), so that its decoding step costs what a larger model's does
    pad: tuple[int, int] | None = None


PRESETS = {
    "tiny": Preset(
        2_000_000,
        {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 8,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
        },
        1024,
        20.0,
        256,
        8,
        3e-3,
        48,
        4,
        48,
        8,
        512,
        1024,
        1,
        1e-3,
        "3",
        "cpu",
        ("--dtype", "float32"),
        ("--dtype", "float32"),
        128,
        ("--temperature", "1.0"),
    ),
    "gpu": Preset(
        30_000_000,
        {
            "hidden_size": 1024,
            "intermediate_size": 2816,
            "num_hidden_layers": 12,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 64,
        },
        16384,
        60.0,
        1024,
        64,
        1e-3,
        1200,
        16,
        160,
        256,
        1024,
        8192,
        3,
        5e-4,
        "2,3,4",
        "cuda",
        ("--gpu-memory-utilization", "0.5", "--enforce-eager"),
        ("--gpu-memory-utilization", "0.6"),
    ),
}
# the gpu preset's learned target padded to 36 layers of MLP width 45,056 (5.1B parameters, 10 GB in bf16:
# ~3 ms of an H100's bandwidth a step, above vLLM's 1.7-2.6 ms of host work): the decode-speed question
PRESETS["gpu-padded"] = dataclasses.replace(PRESETS["gpu"], pad=(45056, 24), k="3,4")
# the same chain on the CPU with a padded tiny target (its smoke test)
PRESETS["tiny-padded"] = dataclasses.replace(PRESETS["tiny"], pad=(512, 4))


def say(message: str) -> None:
    click.echo(message, err=True)


def pipeline(*args, env: dict | None = None) -> float:
    """``python -m pipeline ARGS`` as its own process; its seconds; exits on failure."""
    argv = [sys.executable, "-m", "pipeline", *map(str, args)]
    say(f"\n$ {shlex.join(argv[1:])}")
    t0 = time.perf_counter()
    rc = subprocess.call(argv, env={**os.environ, **(env or {})})
    if rc != 0:
        raise SystemExit(f"draft_value_bench: `pipeline {args[0]}` failed with exit code {rc}")
    return round(time.perf_counter() - t0, 1)


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def release_gpu_memory() -> None:
    """Give back what torch's caching allocator holds in this process, for the engines started next."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_target(work: Path, p: Preset, res: dict) -> None:
    from pipeline.demo.learned import RowSampler, build_learned_model, corpus_texts, docstring_rows

    texts = corpus_texts(p.max_chars, "installed")
    rows = docstring_rows(texts)
    random.Random(0).shuffle(rows)
    for i, row in enumerate(rows):
        row["id"] = f"q{i}"
    held = p.draft_rows + p.eval_prompts
    if len(rows) < held + 100:
        raise SystemExit(f"draft_value_bench: {len(rows)} docstring rows, need more than {held + 100}")
    evals, drafts, train = rows[: p.eval_prompts], rows[p.eval_prompts : held], rows[held:]
    write_rows(work / "prompts.jsonl", [{"id": r["id"], "messages": r["messages"][:2]} for r in evals])
    write_rows(work / "original.jsonl", drafts)
    t0 = time.perf_counter()
    build_learned_model(
        work / "target",
        seconds=p.target_seconds,
        seq_length=p.target_seq,
        batch=p.target_batch,
        lr=p.target_lr,
        texts=texts,
        corpus="installed",
        vocab_size=p.vocab_size,
        device=p.device,
        packed=True,
        sampler=RowSampler(train),
        log=say,
        **p.model,
    )
    release_gpu_memory()  # regenerate's server asks for half the GPU next (H100: 16 of 79 GiB were free)
    res["target"] = {
        **json.loads((work / "target" / "learned.json").read_text()),
        "rows": {"target_train": len(train), "draft": len(drafts), "eval_prompts": len(evals)},
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def pad(work: Path, p: Preset, res: dict) -> None:
    """Pad the learned target in place (it moves to ``target-learned``) before the drafts are evaluated: the
    padded one computes the same function (bench/padded_target.py; its test), so the drafts learned on the
    learned target's states are drafts of it, and only the step's cost changes. A no-op without ``pad``
    or when already padded (a resumed run)."""
    learned, target = work / "target-learned", work / "target"
    if p.pad is None or (learned.exists() and target.exists()):
        return
    from bench.padded_target import pad_target

    if not learned.exists():
        target.rename(learned)
    res["padded"] = pad_target(learned, target, intermediate_size=p.pad[0], extra_layers=p.pad[1])


def regenerate(work: Path, p: Preset, res: dict) -> None:
    from pipeline.regenerate.endpoint import free_port, local_server, serve_argv

    port = free_port()
    argv = serve_argv(
        work / "target",
        port,
        tensor_parallel_size=1,
        max_model_len=p.target_seq + p.regen_max_tokens,
        dtype="auto",
        extra=p.serve_args,
    )
    t0 = time.perf_counter()
    with local_server(argv, port, work / "serve.log", start_timeout=600) as url:
        started = round(time.perf_counter() - t0, 1)
        seconds = pipeline(
            "regenerate",
            "--endpoint",
            url,
            "--data",
            work / "original.jsonl",
            "--out",
            work / "regen",
            "--max-tokens",
            p.regen_max_tokens,
            "--concurrency",
            p.concurrency,
            "--max-rejected",
            "0.9",
            "--overwrite",
            *p.regen_args,
        )
    summary = json.loads((work / "regen" / "summary.json").read_text())
    res["regenerate"] = {
        "server_start_s": started,
        "stage_s": seconds,
        **{
            k: summary[k]
            for k in (
                "rows",
                "kept",
                "rejected",
                "rejected_by_reason",
                "completion_tokens",
                "output_tokens_per_s",
            )
        },
    }


def learned_layer_ids(work: Path, p: Preset) -> tuple[str, ...]:
    """The layers a draft built after padding captures: the learned layers' default ids (the three
    intermediate ones), then the padded target's last layer (whose output is the last learned layer's:
    the padded ones add zero), so that every draft of one run learns the same states."""
    if p.pad is None or not (work / "target-learned").exists():
        return ()
    from pipeline.model.layers import default_layer_ids

    ids = [*default_layer_ids(p.model["num_hidden_layers"])[:3], p.model["num_hidden_layers"] + p.pad[1] - 1]
    return ("--layer-ids", ",".join(map(str, ids)))


def draft(work: Path, p: Preset, name: str, data: Path, res: dict) -> None:
    d = work / name
    times = {
        "prepare": pipeline(
            "prepare",
            "--data",
            data,
            "--model",
            work / "target",
            "--out",
            d / "prepared",
            "--seq-length",
            p.seq_length,
            "--draft-vocab-size",
            p.draft_vocab,
            "--overwrite",
        ),
        "extract": pipeline(
            "extract",
            "--prepared",
            d / "prepared",
            "--model",
            work / "target",
            "--out",
            d / "hidden_states",
            "--backend",
            "hf",
            "--device",
            p.device,
            "--overwrite",
            "--no-progress",
            *learned_layer_ids(work, p),
        ),
    }
    if not (work / "verifier" / "verifier.json").exists():
        times["weights"] = pipeline("weights", "--model", work / "target", "--out", work / "verifier")
    times["train"] = pipeline(
        "train",
        "--data",
        d / "hidden_states",
        "--prepared",
        d / "prepared",
        "--verifier",
        work / "verifier",
        "--model",
        work / "target",
        "--out",
        d / "train",
        "--epochs",
        p.epochs,
        "--lr",
        p.lr,
        "--max-len",
        8192,
        "--ttt-steps",
        3,
        "--eval-k",
        3,
        "--device",
        p.device,
        "--no-plots",
        "--overwrite",
    )
    summary = json.loads((d / "train" / "summary.json").read_text())
    res.setdefault("drafts", {})[name] = {
        "seconds": times,
        "samples": json.loads((d / "prepared" / "metadata.json").read_text())["num_samples"],
        "offline_eval": summary.get("eval"),
    }


def evaluate(work: Path, p: Preset, res: dict, name: str) -> None:
    """``pipeline evaluate`` of one draft: the regenerated one at the preset's k values, both phases; the
    original one at k=3, batch 1 (what the comparison needs)."""
    common = (
        "--model",
        work / "target",
        "--prompts",
        work / "prompts.jsonl",
        "--num-prompts",
        p.eval_prompts,
        "--max-tokens",
        p.max_tokens,
        "--overwrite",
        *p.eval_args,
    )
    more = (
        ("--k", p.k, "--ngram-k", "3")
        if name == "regen"
        else ("--k", "3", "--ngram-k", "0", "--phases", "batch1")
    )
    seconds = pipeline(
        "evaluate",
        *common,
        *more,
        "--draft",
        work / f"{name}-draft" / "train",
        "--out",
        work / f"eval-{name}",
    )
    res.setdefault("evaluate", {})[name] = {
        **json.loads((work / f"eval-{name}" / "evaluate.json").read_text()),
        "stage_s": seconds,
    }
    done = res["evaluate"]
    if "regen" in done:  # either order: each is its own step
        res["goals"] = judge(done["regen"]["rows"], done.get("original", {}).get("rows"))


def judge(rows: list[dict], original: list[dict] | None) -> dict:
    """The issue's goals on the regenerated draft's rows at batch 1: acceptance at k=3 against n-gram k=3's,
    output tok/s of the best k against none and the best n-gram, over whole requests and per output token
    after the first (the decode rate); and, where the original answers' draft ran, what regeneration bought
    at k=3."""
    b1 = {r["label"]: r for r in rows if r["phase"] == "batch1"}
    best = max((r for r in b1.values() if r["method"] == "eagle3"), key=lambda r: r["output_tokens_per_s"])
    ngram = b1["ngram k=3"]
    acc = (b1["eagle3 k=3"]["acceptance_length"] or 1) / (ngram["acceptance_length"] or 1)
    figures = {
        "acceptance_vs_ngram_k3": acc,
        "batch1_vs_none": best["speedup"],
        "batch1_vs_ngram": best["output_tokens_per_s"] / ngram["output_tokens_per_s"],
    }
    decode = {
        "batch1_vs_none": best["decode_speedup"],
        "batch1_vs_ngram": ngram["tpot_ms"] / best["tpot_ms"],
    }
    out = {
        "best": best["label"],
        "figures": figures,
        "met": {k: figures[k] >= GOALS[k] for k in GOALS},
        "decode_figures": decode,
        "decode_met": {k: v >= GOALS[k] for k, v in decode.items()},
    }
    if original:
        o1 = {r["label"]: r for r in original if r["phase"] == "batch1"}
        out["regenerated_vs_original_acceptance_k3"] = (b1["eagle3 k=3"]["acceptance_length"] or 1) / (
            o1["eagle3 k=3"]["acceptance_length"] or 1
        )
    return out


@click.command()
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="tiny", show_default=True)
@click.option("--work", type=click.Path(path_type=Path), required=True, help="Working folder (kept).")
@click.option(
    "--phases",
    default="build,evaluate",
    show_default=True,
    help="build, evaluate, or both; or steps by name (target, regenerate, regen-draft, original-draft, "
    "pad, eval-regen, eval-original).",
)
@click.option("--json", "json_out", type=click.Path(path_type=Path), required=True)
def main(preset: str, work: Path, phases: str, json_out: Path) -> None:
    p = PRESETS[preset]
    work.mkdir(parents=True, exist_ok=True)
    res = json.loads(json_out.read_text()) if json_out.exists() else {"preset": preset, "phases": {}}

    def save() -> None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(res, indent=2))

    steps = {
        "build": [
            ("target", lambda: build_target(work, p, res)),
            ("regenerate", lambda: regenerate(work, p, res)),
            (
                "regen-draft",
                lambda: draft(work, p, "regen-draft", work / "regen" / "conversations.jsonl", res),
            ),
            ("original-draft", lambda: draft(work, p, "original-draft", work / "original.jsonl", res)),
        ],
        "evaluate": [
            ("pad", lambda: pad(work, p, res)),
            ("eval-regen", lambda: evaluate(work, p, res, "regen")),
            ("eval-original", lambda: evaluate(work, p, res, "original")),
        ],
    }
    by_name = {name: (name, step) for group in steps.values() for name, step in group}
    for phase in phases.split(","):
        for name, step in steps.get(phase) or [by_name[phase]]:
            t0 = time.perf_counter()
            step()
            res["phases"][name] = round(time.perf_counter() - t0, 1)
            save()
            say(f"draft_value_bench: {name} done in {res['phases'][name]} s")
    if "goals" in res:
        say(json.dumps(res["goals"], indent=2))
        for name in ("regen", "original"):
            if (work / f"eval-{name}" / "evaluate.md").is_file():
                say(f"\n{name}:\n" + (work / f"eval-{name}" / "evaluate.md").read_text())


if __name__ == "__main__":
    main()
