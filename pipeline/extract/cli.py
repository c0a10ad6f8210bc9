"""The command lines of the extract stage: ``pipeline extract`` and the hidden ``pipeline extract-worker``
that workers.py starts. ``extract`` returns its config for the closing check, which pipeline/cli.py
composes with the verify stage (this package imports no stage)."""

from __future__ import annotations

import sys

import click

from pipeline.errors import StageError
from pipeline.options import from_json, options
from pipeline.ondisk.outdir import output_lock
from pipeline.extract.config import ExtractConfig
from pipeline.extract.loop import first_batch_after
from pipeline.extract.stage import run


@click.command("extract")
@options(ExtractConfig)
@click.option(
    "--json-stats", is_flag=True, hidden=True, help="Print the run's figures as one JSON line (benchmarks)."
)
def command(json_stats: bool, **kwargs) -> ExtractConfig | None:
    """Capture the outputs of 4 decoder layers for every prepared sample."""
    cfg = ExtractConfig(**kwargs)
    shard = f"rank-{cfg.rank}" if cfg.world_size > 1 else ""
    with output_lock(cfg.out, shard):
        stats = run(cfg)
    if json_stats:
        echo_stats(stats)
        return None  # the benchmarks' run: no closing check
    started = first_batch_after(stats)
    click.echo(
        f"extracted {stats['samples']} samples into {cfg.out} ({stats['batches_run']} batches run, "
        f"{stats['resumed_from']} already done; {stats['tokens_per_s']:,.0f} tok/s"
        + (f", device idle {stats['device_idle_fraction']:.0%}" if "device_idle_fraction" in stats else "")
        + (
            f"; first batch {started[0]:.1f} s after start, model load {started[1]:.1f} s)"
            if started
            else ")"
        )
    )
    choice = (stats.get("startup") or {}).get("backend_choice")
    if choice:
        click.echo(f"extract: --backend auto chose {choice}")
    return cfg  # the set written, for the closing check (pipeline/cli.py closing_verify; --no-verify: none)


@click.command("extract-worker", hidden=True)
def worker_command() -> None:
    """One data-parallel worker of `pipeline extract` (launch_workers starts it): its ExtractConfig as JSON on
    stdin, its figures as one JSON line on stdout."""
    cfg = from_json(ExtractConfig, sys.stdin.read())
    if cfg.local_rank is None:
        raise StageError(
            "extract-worker runs one worker of a --data-parallel extract: its config has no local_rank"
        )
    echo_stats(run(cfg))


def echo_stats(stats: dict) -> None:
    """A run's figures (its resolved config left out) as one JSON line: what launch_workers and the
    benchmarks read."""
    import json

    click.echo(json.dumps({k: v for k, v in stats.items() if k != "config"}))
