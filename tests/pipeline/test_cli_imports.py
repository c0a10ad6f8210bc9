"""A command that only shows help or refuses its arguments never imports torch (issue #16): each case is a
real ``python -X importtime -m pipeline ...`` process, and its import log must hold no ``torch`` module;
``pipeline --help`` imports no stage module at all (its list comes from pipeline/cli.py's SUMMARIES)."""

from __future__ import annotations

import os
import re
import subprocess

import click
import pytest

from pipeline.cli import COMMANDS, SUMMARIES, main
from tests.conftest import PYTHON, REPO

# a line of -X importtime's log naming torch or one of its submodules (`import time: 12 | 34 |   torch.nn`)
TORCH_LINE = re.compile(r"^import time:.*\|\s+torch(\.\w+)*\s*$", re.MULTILINE)
MODULE_LINE = re.compile(r"^import time:.*\|\s+([\w.]+)\s*$", re.MULTILINE)

EXTRACT = ("check-args", "extract", "--prepared", "p", "--model", "m", "--out", "o")
# (argv, the exit code it has): the check-args refusals the ops preflight meets, one per way to be refused
REFUSALS = [
    (("check-args", "prepare", "--seq-length", "1"), 2),  # a required option missing
    (("check-args", "prepare", "--data", "d", "--model", "m", "--out", "o", "--seq-length", "1"), 2),  # range
    ((*EXTRACT, "--layer-id", "1"), 2),  # an unknown option
    ((*EXTRACT, "--backend", "x"), 2),  # a value outside a choice
    (("check-args", "verify", "p", "--world-size", "2", "--rank", "2"), 2),  # two fields joined
    (("check-args", "train", "--data", "d", "--verifier", "v", "--out", "o", "--epochs", "0"), 2),
    (("check-args", "nosuch"), 2),
    (("check-args", "weights", "--help"), 2),
]
CASES = (
    [(("--help",), 0)]
    + [((stage, "--help"), 0) for stage in sorted(COMMANDS) if stage != "check-args"]
    + REFUSALS
)


def import_log(args: tuple[str, ...], code: int, run: tuple[str, ...] = ("-m", "pipeline")) -> str:
    """The -X importtime log of `python -m pipeline ARGS`, once the process exited with ``code``."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    proc = subprocess.run(
        [PYTHON, "-X", "importtime", *run, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=600,
    )
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "import time:" in proc.stderr  # the log is there to be read
    return proc.stderr


def torch_lines(args: tuple[str, ...], code: int, run: tuple[str, ...] = ("-m", "pipeline")) -> list[str]:
    """The torch lines of the import log of `python -m pipeline ARGS` (see ``import_log``)."""
    return [m.group(0) for m in TORCH_LINE.finditer(import_log(args, code, run))]


@pytest.mark.parametrize(("args", "code"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_help_and_refusals_do_not_import_torch(args, code):
    """`pipeline --help`, every stage's --help and check-args' refusals finish without torch loaded."""
    assert torch_lines(args, code) == []


def test_the_import_log_shows_torch_where_it_is_loaded():
    """The check above can fail: importing the train loop (which needs torch at the top) shows torch lines."""
    assert torch_lines((), 0, run=("-c", "import pipeline.train.stage"))


def test_the_command_list_imports_no_stage_module():
    """`pipeline --help` lists every command without importing the module of any (nor numpy)."""
    imported = set(MODULE_LINE.findall(import_log(("--help",), 0)))
    stage_modules = {target.split(":")[0] for target in COMMANDS.values()}
    assert "pipeline.cli" in imported  # the log names modules as this test reads them
    assert imported & (stage_modules | {"numpy"}) == set()


def test_the_summaries_are_the_commands_own():
    """Each command's summary in pipeline/cli.py shortens, at every width, to what its own docstring does, so
    that the list `pipeline --help` prints is the one click would make from the commands themselves."""
    assert set(SUMMARIES) == set(COMMANDS)
    for name, text in SUMMARIES.items():
        real = main.get_command(click.Context(main), name)
        stand_in = click.Command(name, help=text)
        for limit in range(10, 200):
            assert stand_in.get_short_help_str(limit) == real.get_short_help_str(limit), (name, limit)
