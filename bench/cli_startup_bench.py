"""Benchmark: the wall time of `python -m pipeline` commands that only answer or refuse (help, check-args).

Each command is a fresh process, as an operator or the test suite starts it; the figure is the median of
--repeat runs, taken in turns (this tree's run, then the baseline's) so that both see the same machine
load. ``--baseline DIR``: another source tree (its own pipeline/ and contract/ come first on PYTHONPATH),
e.g. ``git archive <rev> | tar -x -C /tmp/base``. Needs no GPU, no model, no data.

    python -m bench.cli_startup_bench --repeat 3 --baseline /tmp/base
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import click

from bench.timing import timed

REPO = Path(__file__).resolve().parent.parent
# (argv, the exit code it must end with: a run that ends otherwise did something else, and is no figure)
COMMANDS = (
    (("--help",), 0),
    (("prepare", "--help"), 0),
    (("extract", "--help"), 0),
    (("verify", "--help"), 0),
    (("train", "--help"), 0),
    (("check-args", "prepare", "--seq-length", "1"), 2),
    (("check-args", "prepare", "--data", "d", "--model", "m", "--out", "o", "--seq-length", "1"), 2),
)


def wall_seconds(tree: Path, args: tuple[str, ...], code: int) -> float:
    """One `python -m pipeline ARGS` process run from ``tree``, start to exit; it must exit with ``code``."""
    run = timed(
        [sys.executable, "-m", "pipeline", *args], env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree
    )
    if run.returncode != code:
        last = run.lines[-1][1].strip() if run.lines else ""
        what = f"pipeline {' '.join(args)} in {tree}"
        raise click.ClickException(f"{what} exited {run.returncode}, not {code}: {last}")
    return run.wall


@click.command()
@click.option(
    "--repeat", type=click.IntRange(min=1), default=3, show_default=True, help="Runs per command and tree."
)
@click.option(
    "--baseline",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Another source tree whose commands run in turns with ours, as the 'baseline' column.",
)
def main(repeat: int, baseline: Path | None) -> None:
    trees = {"ours": REPO} | ({"baseline": baseline.resolve()} if baseline else {})
    columns = [f"{who} (median s)" for who in trees] + (["speed-up"] if baseline else [])
    print("| command | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for args, code in COMMANDS:
        runs: dict[str, list[float]] = {who: [] for who in trees}
        for _ in range(repeat):
            for who, tree in trees.items():
                runs[who].append(wall_seconds(tree, args, code))
        med = {who: statistics.median(times) for who, times in runs.items()}
        row = f"| `pipeline {' '.join(args)}` | " + " | ".join(f"{med[who]:.2f}" for who in trees)
        print(row + (f" | {med['baseline'] / med['ours']:.1f}x |" if baseline else " |"), flush=True)


if __name__ == "__main__":
    main()
