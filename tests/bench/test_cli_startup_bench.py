"""bench/cli_startup_bench.py, the command docs/benchmarks.md gives, runs end to end (one run per command);
no figure is asserted, only that every command row is printed and that a command ending with another exit
code than its own fails the benchmark."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest

from bench import cli_startup_bench

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_prints_a_row_per_command():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cli_startup_bench", "--repeat", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| `pipeline ")]
    assert len(rows) == len(cli_startup_bench.COMMANDS), proc.stdout


def test_a_command_that_ends_otherwise_is_no_figure():
    with pytest.raises(click.ClickException, match="exited 0, not 2"):
        cli_startup_bench.wall_seconds(ROOT, ("--help",), 2)
