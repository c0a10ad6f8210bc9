"""Benchmark: the whole path to a trained draft on a random-weight Llama, with throughput and acceptance.

Builds the target (pipeline/demo/tiny.py: random weights, the demo tokenizer, synthetic conversations), then
runs the real stages in-process: prepare -> extract (hf backend) -> weights -> train (speculators' Trainer)
-> offline acceptance. Prints a markdown table and writes every figure to --json after each phase, so a
run cut short by a time limit still reports what it finished.

    python bench/train_bench.py --preset tiny          # CPU, the demo model (8 layers, hidden 256)
    python bench/train_bench.py --preset llama-1b      # GPU, ~1.2B random Llama, seq 2048, draft vocab 32000

``--states-modes offline,online,hybrid`` (issue #31 item 3: training speed online against offline on the
llama-1b shape) then trains the same draft again with ``--states-mode online`` and ``hybrid``, the hf
backend producing the states beside the trainer, within a budget between the least the stage accepts and
the offline set (bench/states_modes.py), each in this process after the offline run, and prints their
speed and acceptance against offline's (the column after epoch 0 leaves out the compile warm-up, which the
first run pays).
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import click
import torch

from bench.states_modes import compare_modes, mode_row, offline_budget, parse_modes, split_mode

PRESETS = {
    # name: model overrides, conversations, seq_length, draft vocab (None = full), train options
    "tiny": (dict(), 200, 256, None, dict(epochs=2, max_len=1024, lr=1e-3)),
    "llama-1b": (
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
        ),
        1500,
        2048,
        32000,
        dict(epochs=2, max_len=2048, lr=3e-4),
    ),
}


class Report:
    def __init__(self, path: Path | None):
        self.path = path
        self.data: dict = {
            "host": platform.node(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "phases": {},
        }

    def phase(self, name: str, seconds: float, **figures) -> None:
        self.data["phases"][name] = {"seconds": round(seconds, 2), **figures}
        click.echo(f"[{name}] {seconds:.1f} s {json.dumps(figures, default=str)[:400]}", err=True)
        self.write()

    def write(self) -> None:
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")


def attention_check(cfg) -> dict:
    """Loss and proposals of the trained draft on one packed batch with speculators' flex kernel and ours."""
    from pipeline.train import draft as draft_mod
    from pipeline.train.runtime import Runtime
    from pipeline.train.inputs import check_inputs
    from pipeline.train.stage import DRAFT, make_loader
    from pipeline.train.trainer import get_trainer_kwargs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    inputs = check_inputs(cfg)
    batch = next(
        iter(
            make_loader(
                inputs.train_files,
                cfg,
                Runtime(device),
                shuffle_seed=0,
                hidden_size=inputs.target.hidden_size,
            )
        )
    )
    # fp32, as the kernels are compared without the trainer's autocast (a GPU's loader hands bf16 states)
    batch = {
        k: v.to(device).float() if v.is_floating_point() else v.to(device)
        for k, v in batch.items()
        if k != "error_records"
    }
    results = {}
    for impl in (draft_mod.FLEX_ATTENTION, draft_mod.DENSE_ATTENTION):  # speculators picks the mask at load
        model = draft_mod.load_draft(cfg.out / DRAFT, attention=impl).to(device).eval()
        call, _ = get_trainer_kwargs(model, cfg, device)
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            tokens, loss, _ = model(**batch, **call)
        results[impl] = (tokens, float(loss))
    (tf, lf), (td, ld) = results.values()
    agree = float(sum((a == b).float().mean() for a, b in zip(tf, td)) / len(tf))
    return {
        "flex_loss": lf,
        "dense_loss": ld,
        "proposal_agreement": agree,
        "documents": int(batch["document_ids"].max()) + 1,
    }


def _timed(fn, *args, **kwargs):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def build_random_set(
    workdir: Path, preset: str, conversations: int | None = None, report: Report | None = None
) -> dict:
    """The random target of ``preset`` and its set, in ``workdir`` (replaced): model/, prepared/,
    hidden_states/ (hf backend, no closing check), verifier/. Each phase's figures go to ``report``; returns
    what the set is."""
    import shutil

    from pipeline import prepare, weights

    from pipeline.extract.config import ExtractConfig

    from pipeline.extract.stage import run as extract_run

    from pipeline.ondisk import formats
    from pipeline.demo import tiny

    report = report or Report(None)
    overrides, n_conv, seq_length, draft_vocab, _ = PRESETS[preset]
    n_conv = conversations or n_conv
    report.data.update(preset=preset, conversations=n_conv, seq_length=seq_length, draft_vocab=draft_vocab)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)

    model, s = _timed(tiny.build_tiny_model, "llama", workdir / "model", seed=0, **overrides)
    convs = tiny.write_conversations(workdir / "conversations.jsonl", n=n_conv, seed=0)
    params = sum(
        p.numel()
        for p in __import__("safetensors.torch", fromlist=["load_file"])
        .load_file(str(model / "model.safetensors"))
        .values()
    )
    report.phase("target", s, parameters=params)

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    meta, s = _timed(
        prepare.run,
        prepare.PrepareConfig(
            data=convs,
            model=model,
            out=workdir / "prepared",
            seq_length=seq_length,
            draft_vocab_size=draft_vocab or vocab,
        ),
    )
    report.phase("prepare", s, samples=meta.num_samples, tokens=meta.num_tokens)

    _, s = _timed(
        extract_run,
        ExtractConfig(
            prepared=workdir / "prepared",
            model=model,
            out=workdir / "hidden_states",
            verify=False,
            progress=False,
        ),
    )
    dc = formats.read_data_config(workdir / "hidden_states")
    report.phase(
        "extract", s, tokens_per_s=round(meta.num_tokens / s, 1), dtype=dc.dtype, layer_ids=dc.layer_ids
    )

    _, s = _timed(weights.run, model, workdir / "verifier")
    report.phase("weights", s)
    return {
        "model": model,
        "meta": meta,
        "data_config": dc,
        "parameters": params,
        "vocab": vocab,
        "seq_length": seq_length,
        "samples": meta.num_samples,
        "tokens": meta.num_tokens,
    }


def parse_hf_modes(ctx, param, value: str) -> list[str]:
    """``--states-modes`` as parse_modes reads it, without a producer's place: this bench's states are the hf
    backend's, whose producer is a thread of the trainer's (bench/learned_bench.py --backend vllm has it)."""
    modes = parse_modes(ctx, param, value)
    if any(split_mode(m)[1] for m in modes):
        raise click.BadParameter("the hf producer has no place to choose: give modes without ':'")
    return modes


@click.command()
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="tiny", show_default=True)
@click.option(
    "--workdir", type=click.Path(path_type=Path), default=Path("runs/bench-train"), show_default=True
)
@click.option(
    "--json", "json_path", type=click.Path(path_type=Path), default=None, help="Write figures here."
)
@click.option("--conversations", type=int, default=None, help="Override the preset's conversation count.")
@click.option("--epochs", type=int, default=None, help="Override the preset's epochs.")
@click.option(
    "--states-modes",
    default="offline",
    show_default=True,
    callback=parse_hf_modes,
    help="Also train the same draft with its states produced while it trains (online,hybrid; issue #31).",
)
def main(
    preset: str,
    workdir: Path,
    json_path: Path | None,
    conversations: int | None,
    epochs: int | None,
    states_modes: list[str],
) -> None:
    """Build a random target, extract, train a draft, measure; print a markdown table."""
    from pipeline.train.stage import TrainConfig, run
    from pipeline.train.cli import quiet_libraries

    quiet_libraries()
    _, _, _, _, train_opts = PRESETS[preset]
    train_opts = {**train_opts, **({"epochs": epochs} if epochs else {})}
    report = Report(json_path)
    built = build_random_set(workdir, preset, conversations, report)
    report.data.update(train=train_opts)
    model, meta, dc, params = built["model"], built["meta"], built["data_config"], built["parameters"]
    vocab, seq_length = built["vocab"], built["seq_length"]

    cfg = TrainConfig(
        data=workdir / "hidden_states",
        verifier=workdir / "verifier",
        out=workdir / "train",
        model=model,
        prepared=workdir / "prepared",
        eval_max_samples=32,
        **train_opts,
    )
    try:
        summary, s = _timed(run, cfg, log=lambda m: click.echo(m, err=True))
    except Exception as exc:  # noqa: BLE001 - e.g. torch.compile on an untested torch: retry once in eager mode
        report.phase("train_failed", 0.0, error=f"{type(exc).__name__}: {exc}"[:500])
        import dataclasses

        torch._dynamo.config.disable = True
        cfg = dataclasses.replace(cfg, overwrite=True)
        summary, s = _timed(run, cfg, log=lambda m: click.echo(m, err=True))
    ev = summary.get("eval", {})
    report.phase("train", s, train=summary["train"], eval=ev)
    try:
        check, s = _timed(attention_check, cfg)
        report.phase("attention_check", s, **check)
    except Exception as exc:  # noqa: BLE001 - a diagnostic; the figures above stand without it
        report.phase("attention_check", 0.0, error=f"{type(exc).__name__}: {exc}"[:300])
    base = ev["baselines"][ev["best_baseline"]] if ev else {}
    rows = [
        (
            "target",
            (
                f"random Llama, {params / 1e9:.2f} B parameters, {dc.num_layers} layers, "
                f"hidden {dc.hidden_size}, vocab {vocab}"
            ),
        ),
        ("data", f"{meta.num_samples} samples, {meta.num_tokens} tokens, seq_length {seq_length}"),
        (
            "extract (hf, ours)",
            f"{meta.num_tokens / report.data['phases']['extract']['seconds']:.0f} tokens/s",
        ),
        (
            "train",
            f"{summary['train']['train_tokens_per_s']} tokens/s over "
            f"{summary['train']['epochs_run_now']} epochs "
            f"({summary['train']['steps_per_epoch']} steps/epoch, {summary['train']['device']})",
        ),
        (
            "draft acceptance length",
            f"{ev.get('draft', {}).get('acceptance_length', float('nan')):.3f} (k={ev.get('k')})",
        ),
        ("per position", ", ".join(f"{x:.3f}" for x in ev.get("draft", {}).get("per_position", []))),
        (f"best baseline ({ev.get('best_baseline')})", f"{base.get('acceptance_length', float('nan')):.3f}"),
        ("greedy tokens inside the draft vocab", f"{ev.get('greedy_in_draft_vocab', float('nan')):.3f}"),
    ]
    click.echo("\n| figure | value |\n|---|---|")
    for k, v in rows:
        click.echo(f"| {k} | {v} |")
    if len(states_modes) > 1 and not produced_modes(cfg, states_modes[1:], workdir, report):
        raise SystemExit("train_bench: a states mode's acceptance is off offline's (above)")


def produced_modes(cfg, modes: list[str], workdir: Path, report: Report) -> bool:
    """Train ``cfg``'s draft again in each of ``modes`` (online/hybrid: the hf backend produces the states
    while it trains) within a budget between the stage's minimum and the offline set; print and record each
    mode against the offline run above. False when a mode's acceptance is off offline's."""
    import dataclasses

    from pipeline.train.stage import run

    produced = dict(states_backend="hf")  # the offline set was extracted with hf (build_random_set)
    minimum, budget = offline_budget(cfg)
    report.data["states_budget"] = {"minimum_bytes": minimum, "budget_bytes": budget}
    for mode in modes:
        mcfg = dataclasses.replace(
            cfg,
            states_mode=mode,
            states_budget=str(budget),
            data=workdir / f"states-{mode}",
            out=workdir / f"train-{mode}",
            overwrite=True,
            **produced,
        )
        summary, s = _timed(run, mcfg, log=lambda m: click.echo(m, err=True))
        report.phase(f"train-{mode}", s, train=summary["train"], eval=summary.get("eval", {}))
    phases = report.data["phases"]
    rows = [mode_row(m, phases["train" if m == "offline" else f"train-{m}"]) for m in ["offline", *modes]]
    lines, failures = compare_modes(rows)
    report.data["states_modes"] = {"rows": rows, "failures": failures}
    report.write()
    click.echo("\n" + "\n".join(lines))
    for failure in failures:
        click.echo(failure, err=True)
    return not failures


if __name__ == "__main__":
    main()
