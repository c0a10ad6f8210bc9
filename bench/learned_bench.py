"""Benchmark: a draft made by this pipeline, for a target that has learned something (issue #17 item 4).

Builds the target in process (pipeline/demo/learned.py: a BPE tokenizer and a Llama trained for a time budget
on real offline text, the stdlib's and the installed packages' sources and docs, saved with its chat
template), draws held-apart "continue this file" prompts and has the target answer them greedily (its own
words: what EAGLE drafts are trained on, and what the offline acceptance compares with), then runs the
product's real command lines, each its own process: ``prepare -> extract (hf) -> weights -> train -> verify``.
The train stage closes with the offline acceptance at k=3 against its trivial baselines; this script reads it
from ``train/summary.json``, prints one table, checks the goal (>= 2.5 and >= 1.3x the best trivial,
context-free baseline; vLLM's n-gram prompt lookup is reported beside it) and writes every figure to
--json after each phase, so a run cut short still reports what it finished. GPU utilisation and memory
(NVML, sampled every 0.5 s) are recorded per phase.

    python bench/learned_bench.py --preset h200 --json runs/bench-learned.json  # one GPU, ~10 min
    python bench/learned_bench.py --preset tiny                                 # CPU, ~2 min (the smoke test)

It does not serve the draft (no GPU vLLM here): the figure is the offline one (docs/train.md says how it
differs).

``--states-modes offline,online,hybrid`` (issue #31 items 2-3; default ``offline``: the run above alone) then
trains the same draft again per listed mode, side by side on the same prepared set, options, steps and seed:
online and hybrid with ``pipeline train --states-mode MODE --states-budget B`` into their own states dir,
B being the least the train stage accepts (the states it keeps all run plus the largest training sample,
from its own plan) plus half of what the offline set holds beyond that, so that online deletes what it reads
and hybrid keeps only part. It prints one row per mode (acceptance at k=3 and its delta to offline's, the
stage's wall seconds, the trainer's tokens/s, the trainer's wait for states and the producer's wait for
room), writes them to --json under ``states_modes``, and exits non-zero when a mode's acceptance is more
than 0.05 from offline's.

    python bench/learned_bench.py --preset tiny --states-modes offline,online,hybrid
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Self

import click

from bench.states_modes import (
    ACCEPTANCE_TOLERANCE,
    STATES_SHARE,
    budget_between,
    compare_modes,
    least_budget,
    mode_row,
    parse_modes,
    split_mode,
)
from bench.train_bench import Report

GOAL_ACCEPTANCE, GOAL_RATIO = 2.5, 1.3  # issue #17 item 4, against the trivial baselines
NGRAM = "ngram_context"  # pipeline/train/evaluate.py's vLLM prompt-lookup baseline


@dataclasses.dataclass(frozen=True)
class Preset:
    """One size of the recipe: the target, its data, and the draft's training."""

    corpus: str  # pipeline/demo/learned.py CORPORA
    max_chars: int  # corpus cap
    tokenizer_chars: int | None  # share of the corpus the BPE merges are learned on
    vocab_size: int
    model: dict  # LlamaConfig overrides (pipeline/demo/tiny.py defaults)
    target_seconds: float  # the target's training budget
    target_seq: int
    target_batch: int
    target_lr: float
    prompt_lines: int
    answer_lines: int
    conversations: int  # prompts the target answers: the draft's data
    max_new_tokens: int
    gen_batch: int
    seq_length: int  # prepare --seq-length
    train: dict  # pipeline train options
    eval_max_samples: int


PRESETS = {
    "tiny": Preset(
        "stdlib",
        600_000,
        None,
        1024,
        {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 8,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
        },
        10.0,
        128,
        4,
        3e-3,
        6,
        10,
        24,
        16,
        24,
        512,
        {"epochs": 1, "max_len": 1024, "lr": 1e-3},
        8,
    ),
    "h200": Preset(
        "installed",
        100_000_000,
        20_000_000,
        16384,
        {
            "hidden_size": 1024,
            "intermediate_size": 2816,
            "num_hidden_layers": 12,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 64,
        },
        120.0,
        1024,
        64,
        1e-3,
        8,
        16,
        2500,
        192,
        1024,
        1024,
        {"epochs": 5, "max_len": 8192, "lr": 5e-4},
        128,
    ),
}


def verdict(ev: dict) -> dict:
    """The goal of issue #17 item 4 judged on the train stage's offline evaluation ``ev``: the draft's
    acceptance length >= GOAL_ACCEPTANCE and >= GOAL_RATIO x the best trivial (context-free) baseline.
    vLLM's n-gram prompt lookup is a serving method of its own, not a trivial proposer: it is reported
    beside the goal (a draft that does not beat it is not worth serving, and `pipeline verify` fails it)."""
    al = ev["draft"]["acceptance_length"]
    trivial = {n: r["acceptance_length"] for n, r in ev["baselines"].items() if n != NGRAM}
    best = max(trivial, key=trivial.__getitem__)
    ratio = al / trivial[best]
    ngram = ev["baselines"].get(NGRAM, {}).get("acceptance_length")
    return {
        "acceptance_length": al,
        "per_position": ev["draft"]["per_position"],
        "best_trivial_baseline": best,
        "best_trivial_baseline_acceptance": trivial[best],
        "ratio": round(ratio, 3),
        "goal": f">= {GOAL_ACCEPTANCE} and >= {GOAL_RATIO}x the best trivial baseline",
        "goal_met": al >= GOAL_ACCEPTANCE and ratio >= GOAL_RATIO,
        "ngram_acceptance": ngram,
        "ratio_ngram": round(al / ngram, 3) if ngram else None,
        "beats_ngram": al > ngram if ngram else None,
    }


def verdict_rows(res: dict) -> list[tuple[str, str]]:
    """The closing table's rows for a `verdict`."""
    rows = [
        (
            f"goal ({res['goal']})",
            f"{'MET' if res['goal_met'] else 'NOT MET'}: {res['acceptance_length']:.3f}, "
            f"{res['ratio']:.2f}x {res['best_trivial_baseline']}",
        )
    ]
    if res["ngram_acceptance"]:
        ahead = "ahead" if res["beats_ngram"] else "NOT ahead: `pipeline verify` fails such a draft"
        rows.append(("vs vLLM's n-gram prompt lookup", f"{res['ratio_ngram']:.2f}x ({ahead})"))
    return rows


class GpuSampler:
    """Mean GPU utilisation and peak memory of device 0 over a phase (NVML every 0.5 s); empty without a
    GPU."""

    def __init__(self):
        self.samples: list[tuple[int, int]] = []
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # noqa: BLE001 - no NVML, no GPU: the figures are simply absent
            self._nvml = None

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
            mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used
            self.samples.append((int(util), int(mem)))

    def __enter__(self) -> Self:
        if self._nvml:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def figures(self) -> dict:
        if not self.samples:
            return {}
        return {
            "gpu_util_mean_pct": round(sum(u for u, _ in self.samples) / len(self.samples), 1),
            "gpu_mem_peak_gib": round(max(m for _, m in self.samples) / 2**30, 1),
        }


def stage(args: list[str], may_fail: bool = False, env: dict | None = None) -> tuple[float, int]:
    """Run ``python -m pipeline ARGS`` as its own process; its seconds and exit code. Exits on failure unless
    ``may_fail``."""
    prefix = [f"{k}={v}" for k, v in (env or {}).items()]
    click.echo(f"\n$ {shlex.join([*prefix, 'python', '-m', 'pipeline', *args])}", err=True)
    t0 = time.perf_counter()
    rc = subprocess.call([sys.executable, "-m", "pipeline", *args], env={**os.environ, **(env or {})})
    if rc != 0 and not may_fail:
        raise SystemExit(f"learned_bench: stage `{args[0]}` failed with exit code {rc}")
    return time.perf_counter() - t0, rc


def plan(work: Path, p: Preset, device: str, vocab: int, backend: str = "hf") -> list[tuple[str, list[str]]]:
    """The stage command lines, in order; extract runs ``backend`` (hf on ``device``, or vllm on every
    visible GPU)."""
    model, prepared, states, verifier, train = (
        str(work / n) for n in ("model", "prepared", "hidden_states", "verifier", "train")
    )
    return [
        (
            "prepare",
            [
                "prepare",
                "--data",
                str(work / "conversations.jsonl"),
                "--model",
                model,
                "--out",
                prepared,
                "--seq-length",
                str(p.seq_length),
                "--draft-vocab-size",
                str(vocab),
                "--overwrite",
            ],
        ),
        (
            "extract",
            [
                "extract",
                "--prepared",
                prepared,
                "--model",
                model,
                "--out",
                states,
                "--backend",
                backend,
                *(("--device", device) if backend == "hf" else ()),
                "--overwrite",
                "--no-progress",
            ],
        ),
        ("weights", ["weights", "--model", model, "--out", verifier, "--overwrite"]),
        ("train", train_args(work, p, device, "offline")),
        ("verify", ["verify", train]),
    ]


def mode_dirs(work: Path, mode: str) -> tuple[Path, Path]:
    """The states dir and the output of the draft trained in ``mode``: offline reads extract's set."""
    if mode == "offline":
        return work / "hidden_states", work / "train"
    name = mode.replace(":", "-")  # online:process
    return work / f"states-{name}", work / f"train-{name}"


def train_flags(work: Path, states: Path, out: Path, epochs: int, max_len: int, lr: float) -> list[str]:
    """The train stage's inputs and output (the layout `plan` makes under ``work``) and its schedule, 3 TTT
    steps: what every bench's draft shares."""
    inputs = [("--data", states), *((f"--{n}", work / n) for n in ("prepared", "verifier", "model"))]
    schedule = {"--epochs": epochs, "--max-len": max_len, "--lr": lr, "--ttt-steps": 3}
    pairs = [*inputs, ("--out", out), *schedule.items()]
    return [*(str(x) for pair in pairs for x in pair), "--overwrite"]


def train_args(
    work: Path, p: Preset, device: str, mode: str, budget: int | None = None, backend: str = "hf"
) -> list[str]:
    """The train stage's command line in states ``mode``: the same draft, data, steps and seed in every mode;
    online/hybrid produce their states with extract's ``backend`` within ``budget`` bytes (hf on ``device``,
    the trainer's; vllm on every visible GPU, beside the trainer with pipeline train's memory share)."""
    t = p.train
    args = [
        "train",
        *train_flags(work, *mode_dirs(work, mode), t["epochs"], t["max_len"], t["lr"]),
        "--eval-k",
        "3",
        "--device",
        device,
        "--eval-max-samples",
        str(p.eval_max_samples),
        "--no-plots",
    ]
    if mode != "offline":
        states_mode, producer = split_mode(mode)
        args += ["--states-mode", states_mode, "--states-budget", str(budget), "--states-backend", backend]
        args += ["--states-producer", producer] if producer else []
        args += ["--states-device", device] if backend == "hf" else []
    return args


def states_minimum(work: Path, p: Preset, device: str, backend: str = "hf") -> int:
    """The least --states-budget the train stage accepts for this run's command line (``least_budget`` of
    its own plan). Reads the prepared set, the target's config and the verifier; loads no model."""
    from pipeline.train.cli import command
    from pipeline.train.config import TrainConfig
    from pipeline.train.inputs import produced_inputs

    args = train_args(work, p, device, "online", budget=2**60, backend=backend)  # room enough to plan
    with command.make_context("pipeline train", args[1:]) as ctx:
        _, produced = produced_inputs(TrainConfig(**ctx.params))
    return least_budget(produced)


def train_figures(out: Path) -> dict:
    """The train stage's own figures: its summary's ``train`` (tokens/s, and ``states`` for online/hybrid)
    and ``eval`` (the acceptance at k=3)."""
    summary = json.loads((out / "summary.json").read_text())
    return {"train": summary["train"], "eval": summary.get("eval")}


def shown(args: list[str], env: dict) -> str:
    """A stage's command line as the report shows it."""
    return shlex.join([*(f"{k}={v}" for k, v in env.items()), "python", "-m", "pipeline", *args])


def _free_gpu() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _dir_gib(path: Path) -> float:
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**30, 2)


@click.command()
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="tiny", show_default=True)
@click.option(
    "--workdir", type=click.Path(path_type=Path), default=Path("runs/bench-learned"), show_default=True
)
@click.option(
    "--json", "json_path", type=click.Path(path_type=Path), default=None, help="Write figures here."
)
@click.option(
    "--target-seconds", type=float, default=None, help="Override the preset's target training budget."
)
@click.option(
    "--conversations", type=int, default=None, help="Override the preset's number of draft conversations."
)
@click.option("--epochs", type=int, default=None, help="Override the preset's draft epochs.")
@click.option(
    "--device", default="auto", show_default=True, help="auto (cuda when there is one) | cpu | cuda."
)
@click.option(
    "--keep-states/--drop-states", default=False, show_default=True, help="Keep hidden_states/ afterwards."
)
@click.option(
    "--train-compile/--no-train-compile",
    default=True,
    show_default=True,
    help="Let speculators torch.compile the draft's forward in the train stage (the product's default; it "
    "now trains with the eager loss, which the compiler fuses, see pipeline/train/stage.py "
    "loss_implementation). Off: TORCHDYNAMO_DISABLE=1, flex attention runs eager (slow on a GPU).",
)
@click.option(
    "--states-modes",
    default="offline",
    show_default=True,
    callback=parse_modes,
    help="Train the draft once per listed states mode (offline,online,hybrid), side by side on the same "
    "prepared set, draft, steps and seed; compare acceptance and speed with offline's. With --backend "
    "vllm, online:process or online:thread (hybrid too) also sets where the producer's engine runs.",
)
@click.option(
    "--backend",
    type=click.Choice(["hf", "vllm"]),
    default="hf",
    show_default=True,
    help="The extract backend: offline's extract stage and online/hybrid's producer (--states-backend).",
)
def main(
    preset: str,
    workdir: Path,
    json_path: Path | None,
    target_seconds: float | None,
    conversations: int | None,
    epochs: int | None,
    device: str,
    keep_states: bool,
    train_compile: bool,
    states_modes: list[str],
    backend: str,
) -> None:
    """Train a target on real text, make a draft for it with the pipeline's CLIs, report acceptance vs
    baselines."""
    import torch

    from pipeline.demo import learned

    p = PRESETS[preset]
    p = dataclasses.replace(
        p,
        target_seconds=target_seconds or p.target_seconds,
        conversations=conversations or p.conversations,
        train={**p.train, **({"epochs": epochs} if epochs else {})},
    )
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    report = Report(json_path)  # bench/train_bench.py's: every phase's figures rewritten to --json as it ends
    report.data.update(
        preset=preset,
        device=device,
        backend=backend,
        recipe=dataclasses.asdict(p),
        command=shlex.join(["python", *sys.argv]),
    )
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    t_all = time.perf_counter()

    with GpuSampler() as gpu:
        t0 = time.perf_counter()
        texts = learned.corpus_texts(p.max_chars, p.corpus)
        learned.build_learned_model(
            workdir / "model",
            seconds=p.target_seconds,
            seed=0,
            corpus=p.corpus,
            max_chars=p.max_chars,
            tokenizer_chars=p.tokenizer_chars,
            vocab_size=p.vocab_size,
            device=device,
            packed=True,
            seq_length=p.target_seq,
            batch=p.target_batch,
            lr=p.target_lr,
            prompt_lines=p.prompt_lines,
            answer_lines=p.answer_lines,
            texts=texts,
            log=lambda m: click.echo(m, err=True),
            **p.model,
        )
    _free_gpu()
    record = json.loads((workdir / "model" / learned.RECORD).read_text())
    report.phase("target", time.perf_counter() - t0, record=record, **gpu.figures())

    with GpuSampler() as gpu:
        t0 = time.perf_counter()
        prompts = learned.make_conversations(
            texts,
            p.conversations,
            seed=1000,
            prompt_lines=p.prompt_lines,
            answer_lines=p.answer_lines,
            weighted=True,
        )
        del texts
        rows, gen = learned.regenerate(
            workdir / "model",
            prompts,
            max_new_tokens=p.max_new_tokens,
            batch=p.gen_batch,
            device=device,
            # room for a whole batch of the longest prompts: HF generate is bound by its per-step overhead
            batch_tokens=p.gen_batch * p.seq_length,
        )
        learned.write_rows(workdir / "conversations.jsonl", rows)
        learned.write_rows(
            workdir / "conversations-corpus.jsonl", prompts
        )  # the corpus's own answers, for reference
    _free_gpu()  # the stages below are other processes on the same GPU
    report.phase("regenerate", time.perf_counter() - t0, **gen, **gpu.figures())
    sample = rows[0]["messages"]
    click.echo(
        f"--- a prompt and the target's answer ---\n{sample[1]['content'][-400:]}\n>>>\n"
        f"{sample[2]['content'][:600]}\n---",
        err=True,
    )

    vocab = json.loads((workdir / "model" / "config.json").read_text())["vocab_size"]
    commands = plan(workdir, p, device, vocab, backend)
    train_env = {} if train_compile else {"TORCHDYNAMO_DISABLE": "1"}
    report.data["stages"] = [shown(args, train_env if name == "train" else {}) for name, args in commands]
    report.write()
    for name, args in commands:
        with GpuSampler() as gpu:
            seconds, rc = stage(
                args, may_fail=name == "verify", env=train_env if name == "train" else None
            )  # verify fails a draft that does not beat its baselines
        figures = {**gpu.figures(), **({"exit_code": rc} if name == "verify" else {})}
        if name == "prepare":
            meta = json.loads((workdir / "prepared" / "metadata.json").read_text())
            figures.update({k: meta.get(k) for k in ("num_samples", "num_tokens")})
        if name == "extract":
            figures["size_gib"] = _dir_gib(workdir / "hidden_states")
            figures["tokens_per_s"] = round(report.data["phases"]["prepare"]["num_tokens"] / seconds, 1)
        if name == "train":
            figures.update(train_figures(workdir / "train"))
        report.phase(name, seconds, **figures)
    produced_modes = states_modes[1:]  # offline's draft is the one trained above
    if produced_modes:
        from pipeline.train.states import state_file_bytes

        offline_bytes = state_file_bytes(workdir / "hidden_states")
        minimum = states_minimum(workdir, p, device, backend)
        budget = budget_between(minimum, offline_bytes)
        report.data["states_budget"] = {
            "offline_bytes": offline_bytes,
            "minimum_bytes": minimum,
            "budget_bytes": budget,
            "share_beyond_minimum": STATES_SHARE,
        }
    for mode in produced_modes:
        args = train_args(workdir, p, device, mode, budget, backend)
        report.data["stages"].append(shown(args, train_env))
        with GpuSampler() as gpu:
            seconds, _ = stage(args, env=train_env)
        states_dir, out = mode_dirs(workdir, mode)
        report.phase(f"train-{mode}", seconds, **gpu.figures(), **train_figures(out))
        if not keep_states:
            shutil.rmtree(states_dir, ignore_errors=True)
    if not keep_states:
        shutil.rmtree(workdir / "hidden_states", ignore_errors=True)

    ev = report.data["phases"]["train"]["eval"]
    res = report.data["result"] = verdict(ev)
    res["total_seconds"] = round(time.perf_counter() - t_all, 1)
    draft = ev["draft"]
    report.write()
    tr = report.data["phases"]["train"]["train"]
    rows_out = [
        (
            "target",
            (
                f"Llama {record['parameters'] / 1e6:.0f} M parameters "
                f"({p.model.get('num_hidden_layers')} layers, "
                f"hidden {p.model.get('hidden_size', 256)}, vocab {vocab}), {record['steps']} steps / "
                f"{record['tokens'] / 1e6:.1f} M tokens in {record['seconds']:.0f} s "
                f"({record['tokens_per_s']:,.0f} tok/s), "
                f"loss {record['loss_first']:.2f} -> {record['loss_last']:.2f}"
            ),
        ),
        ("corpus", f"{p.corpus}: {record['corpus_files']} files, {record['corpus_chars'] / 1e6:.1f} M chars"),
        (
            "draft data",
            (
                f"{gen['rows']} prompts answered by the target "
                f"({gen['mean_new_tokens']:.0f} new tokens each, "
                f"{gen['ended_with_eot']:.0%} ended by itself); "
                f"{report.data['phases']['prepare']['num_tokens']} tokens after prepare"
            ),
        ),
        (
            "draft train",
            (
                f"{tr.get('train_tokens_per_s')} tokens/s, {tr.get('epochs_run_now')} epochs, "
                f"{report.data['phases']['train']['seconds']:.0f} s (stage, eval included)"
            ),
        ),
        (
            f"draft acceptance length (k={ev['k']})",
            (
                f"{draft['acceptance_length']:.3f} "
                f"(per position {', '.join(f'{x:.3f}' for x in draft['per_position'])})"
            ),
        ),
    ]
    rows_out += [(f"baseline {n}", f"{r['acceptance_length']:.3f}") for n, r in ev["baselines"].items()]
    rows_out += verdict_rows(res)
    click.echo("\n| figure | value |\n|---|---|")
    for k, v in rows_out:
        click.echo(f"| {k} | {v} |")
    if produced_modes:
        phases = report.data["phases"]
        modes = [mode_row(m, phases["train" if m == "offline" else f"train-{m}"]) for m in states_modes]
        lines, failures = compare_modes(modes)
        report.data["states_modes"] = {"rows": modes, "tolerance": ACCEPTANCE_TOLERANCE, "failures": failures}
        report.write()
        click.echo("\n" + "\n".join(lines))
        if failures:
            raise SystemExit("learned_bench: " + "; ".join(failures))


if __name__ == "__main__":
    main()
