"""The project's Python passes ruff as pyproject.toml configures it (pycodestyle errors and warnings,
pyflakes, lines of at most 110 columns) and is in ruff's format; ruff is pinned in requirements/dev.txt."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PATHS = ("contract", "ops", "pipeline", "bench", "tests", "docker", "patches")


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *PATHS], cwd=REPO, capture_output=True, text=True, check=False
    )


def test_ruff_check_is_clean():
    """`ruff check` finds nothing: no line over the limit, no unused or undefined name."""
    res = ruff("check", "--output-format", "concise", "--no-cache")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-1000:]


def test_code_is_in_ruffs_format():
    """`ruff format --check` would reformat nothing (run `make lint-fix` to apply it)."""
    res = ruff("format", "--check", "--no-cache")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-1000:]
