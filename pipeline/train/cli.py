"""``python -m pipeline train``: flags -> TrainConfig -> pipeline.train.stage.run, and the acceptance table.

Owns the command line of the train stage only. Data parallel:
``torchrun --nproc-per-node N -m pipeline train ...``.
"""

from __future__ import annotations

import logging
import sys

import click

from pipeline.options import options
from pipeline.train.config import TrainConfig


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

    from pipeline.train.evaluate import table_rows

    ev = summary.get("eval")
    if not ev:
        return
    table = Table(
        title=f"offline acceptance, k={ev['k']}, {ev['samples']} held-out samples, "
        f"{ev['positions']} positions"
    )
    table.add_column("proposer")
    table.add_column("acceptance length")
    for j in range(ev["k"]):
        table.add_column(f"pos {j + 1}")
    for name, length, rates in table_rows(ev):
        table.add_row(name, length, *rates)
    online = ev.get("online")
    if online and online.get("acceptance_length") is not None:
        rates = [f"{x:.3f}" for x in online["per_position"]] + [""] * (ev["k"] - len(online["per_position"]))
        table.add_row(
            f"trained draft, online (vLLM, {online['prompts']} prompts)",
            f"{online['acceptance_length']:.3f}",
            *rates[: ev["k"]],
        )
    console = Console()
    console.print(table)
    if online:
        same = "equals" if online["greedy_equal"] else "DIFFERS from"
        console.print(
            f"vLLM greedy output with the draft {same} the target alone "
            f"({online['greedy_equal_prompts']}/{online['prompts']} prompts, {online['drafts']} drafts)"
        )
    console.print(f"target's greedy tokens inside the draft vocab: {ev['greedy_in_draft_vocab']:.1%}")
    verdict = "beats" if ev["beats_baseline"] else "does NOT beat"
    console.print(
        f"trained draft {verdict} the best trivial baseline ({ev['best_baseline']}): "
        f"{ev['draft']['acceptance_length']:.3f} vs "
        f"{ev['baselines'][ev['best_baseline']]['acceptance_length']:.3f}"
    )


@click.command("train")
@options(TrainConfig)
def command(**kwargs) -> None:
    """Train an EAGLE-3 draft with speculators; measure its offline acceptance against trivial baselines."""
    from pipeline.train.stage import run

    quiet_libraries()
    summary = run(TrainConfig(**kwargs), log=lambda m: click.echo(m, err=True))
    print_table(summary)
