"""``python -m pipeline train``: flags -> TrainConfig -> pipeline.train.run, and the acceptance table.

Owns the command line of the train stage only. Data parallel: ``torchrun --nproc-per-node N -m pipeline train ...``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from pipeline.train import TrainConfig

_P = click.Path(path_type=Path)


def quiet_libraries() -> None:
    """speculators logs each tensor lookup through loguru at INFO; keep warnings only."""
    try:
        from loguru import logger

        logger.remove()
        logger.add(sys.stderr, level="WARNING")
    except ImportError:  # pragma: no cover - loguru is a speculators dependency
        pass
    logging.getLogger("speculators").setLevel(logging.WARNING)


def print_table(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from pipeline.evaluate import table_rows

    ev = summary.get("eval")
    if not ev:
        return
    table = Table(title=f"offline acceptance, k={ev['k']}, {ev['samples']} held-out samples, {ev['positions']} positions")
    table.add_column("proposer")
    table.add_column("acceptance length")
    for j in range(ev["k"]):
        table.add_column(f"pos {j + 1}")
    for name, length, rates in table_rows(ev):
        table.add_row(name, length, *rates)
    online = ev.get("online")
    if online and online.get("acceptance_length") is not None:
        rates = [f"{x:.3f}" for x in online["per_position"]] + [""] * (ev["k"] - len(online["per_position"]))
        table.add_row(f"trained draft, online (vLLM, {online['prompts']} prompts)", f"{online['acceptance_length']:.3f}", *rates[: ev["k"]])
    console = Console()
    console.print(table)
    if online:
        same = "equals" if online["greedy_equal"] else "DIFFERS from"
        console.print(f"vLLM greedy output with the draft {same} the target alone "
                      f"({online['greedy_equal_prompts']}/{online['prompts']} prompts, {online['drafts']} drafts)")
    console.print(f"target's greedy tokens inside the draft vocab: {ev['greedy_in_draft_vocab']:.1%}")
    verdict = "beats" if ev["beats_baseline"] else "does NOT beat"
    console.print(f"trained draft {verdict} the best trivial baseline ({ev['best_baseline']}): "
                  f"{ev['draft']['acceptance_length']:.3f} vs {ev['baselines'][ev['best_baseline']]['acceptance_length']:.3f}")


@click.command("train")
@click.option("--data", type=_P, required=True, help="Hidden-states dir (pipeline extract).")
@click.option("--verifier", type=_P, required=True, help="Verifier weights dir (pipeline weights).")
@click.option("--out", type=_P, required=True, help="Output dir: checkpoints/, draft/, summary.json, plots.")
@click.option("--prepared", type=_P, default=None, help="Dir with d2t.npy/t2d.npy/token_freq.pt [default: from data_config.json].")
@click.option("--model", type=_P, default=None, help="Target model dir, config.json only [default: verifier.json source].")
@click.option("--epochs", type=int, default=3, show_default=True)
@click.option("--lr", type=float, default=1e-4, show_default=True)
@click.option("--ttt-steps", type=int, default=3, show_default=True, help="Training-time-test steps.")
@click.option("--ttt-step-loss-decay", type=float, default=1.0, show_default=True)
@click.option("--num-layers", type=int, default=1, show_default=True, help="Draft decoder layers.")
@click.option("--intermediate-size", type=int, default=None, help="Draft MLP width [default: the target's].")
@click.option("--norm-before-residual/--no-norm-before-residual", default=False, show_default=True)
@click.option("--max-len", type=int, default=2048, show_default=True, help="Tokens per packed batch.")
@click.option("--eval-fraction", type=float, default=0.1, show_default=True, help="Share of samples held out.")
@click.option("--eval-k", type=int, default=None, help="Draft tokens per position when measuring [default: --ttt-steps].")
@click.option("--eval-max-samples", type=int, default=64, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--resume", is_flag=True, help="Continue from the last complete epoch in OUT/checkpoints.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output dir.")
@click.option("--stop-after-epochs", type=int, default=None, help="Train at most N epochs now; continue later with --resume.")
@click.option("--scheduler", type=click.Choice(["linear", "cosine", "none"]), default="linear", show_default=True)
@click.option("--warmup-steps", type=int, default=None)
@click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda | cuda:N")
@click.option("--attention", type=click.Choice(["auto", "flex", "dense"]), default="auto", show_default=True)
@click.option("--num-workers", type=int, default=None, help="Data loader workers [default: 0 on CPU, 4 on GPU].")
@click.option("--save-dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16", show_default=True)
@click.option("--draft-vocab-size", type=int, default=None, help="Expected draft vocab size (checked against d2t).")
@click.option("--trust-remote-code", is_flag=True,
              help="Read the target's config.json through its own Python code (e.g. Kimi-K2.5), not as plain JSON.")
@click.option("--online-eval", is_flag=True,
              help="Also serve the draft with vLLM (EAGLE-3 speculative decoding) on held-out prompts and report vLLM's acceptance.")
@click.option("--online-prompts", type=int, default=16, show_default=True)
@click.option("--online-max-tokens", type=int, default=32, show_default=True)
@click.option("--no-eval", "evaluate", is_flag=True, flag_value=False, default=True, help="Skip the acceptance measurement.")
@click.option("--no-plots", "plots", is_flag=True, flag_value=False, default=True, help="Skip the PNG plots.")
def command(**kwargs) -> None:
    """Train an EAGLE-3 draft with speculators; measure its offline acceptance against trivial baselines."""
    from pipeline.train import run

    quiet_libraries()
    summary = run(TrainConfig(**kwargs), log=lambda m: click.echo(m, err=True))
    print_table(summary)
