"""The project's Python passes ruff as pyproject.toml configures it (pycodestyle errors and warnings,
pyflakes, lines of at most 110 columns) and is in ruff's format; ruff is pinned in requirements/dev.txt. And
no two test modules share a name, which pytest's default import mode needs to collect them in one run."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
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


def shared_names(root: Path) -> list[str]:
    """The test modules' file names found in more than one folder under ``root``."""
    names = Counter(p.name for p in root.rglob("test_*.py"))
    return sorted(n for n, k in names.items() if k > 1)


def test_test_modules_have_unique_names(tmp_path):
    """tests/ has no __init__.py files, so pytest imports each test module by its file name: a second
    tests/*/test_x.py stops `make test-fast` at collection ("import file mismatch"), while `make test`, whose
    suites each collect one folder, passes."""
    assert shared_names(REPO / "tests") == []
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "test_x.py").write_text("")
    assert shared_names(tmp_path) == ["test_x.py"]
