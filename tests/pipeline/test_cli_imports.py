"""A command that only shows help or refuses its arguments never imports torch (issue #16): each case is a
real ``python -X importtime -m pipeline ...`` process, and its import log must hold no ``torch`` module."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from pipeline.cli import COMMANDS
from tests.conftest import PYTHON, REPO

# a line of -X importtime's log naming torch or one of its submodules (`import time: 12 | 34 |   torch.nn`)
TORCH_LINE = re.compile(r"^import time:.*\|\s+torch(\.\w+)*\s*$", re.MULTILINE)

# (argv, the exit code it has): the check-args refusals the ops preflight meets, one per way to be refused
REFUSALS = [
    (("check-args", "prepare", "--seq-length", "1"), 2),  # a required option missing
    (("check-args", "prepare", "--data", "d", "--model", "m", "--out", "o", "--seq-length", "1"), 2),  # range
    (("check-args", "extract", "--prepared", "p", "--model", "m", "--out", "o", "--layer-id", "1"), 2),  # unknown
    (("check-args", "extract", "--prepared", "p", "--model", "m", "--out", "o", "--backend", "x"), 2),  # choice
    (("check-args", "verify", "p", "--world-size", "2", "--rank", "2"), 2),  # two fields joined
    (("check-args", "train", "--data", "d", "--verifier", "v", "--out", "o", "--epochs", "0"), 2),
    (("check-args", "nosuch"), 2),
    (("check-args", "weights", "--help"), 2),
]
CASES = ([(("--help",), 0)] + [((stage, "--help"), 0) for stage in sorted(COMMANDS) if stage != "check-args"]
         + REFUSALS)


def torch_lines(args: tuple[str, ...], code: int, run: tuple[str, ...] = ("-m", "pipeline")) -> list[str]:
    """The torch lines of `python -m pipeline ARGS`'s import log, once the process exited with ``code``."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    proc = subprocess.run([PYTHON, "-X", "importtime", *run, *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=600)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "import time:" in proc.stderr  # the log is there to be read
    return [m.group(0) for m in TORCH_LINE.finditer(proc.stderr)]


@pytest.mark.parametrize(("args", "code"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_help_and_refusals_do_not_import_torch(args, code):
    """`pipeline --help`, every stage's --help and check-args' refusals finish without torch loaded."""
    assert torch_lines(args, code) == []


def test_the_import_log_shows_torch_where_it_is_loaded():
    """The check above can fail: importing the train loop (which needs torch at the top) shows torch lines."""
    assert torch_lines((), 0, run=("-c", "import pipeline.train"))
