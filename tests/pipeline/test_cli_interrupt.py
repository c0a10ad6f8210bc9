"""pipeline/cli.py: Ctrl-C ends a stage with 130 and "aborted", also when a library catches the
KeyboardInterrupt and raises its own error instead (pydantic does, while speculators serializes a checkpoint's
config: a SIGINT that landed there once ended `pipeline train` with a traceback and exit 1). Real processes,
a real SIGINT."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, click
    import pipeline.cli as cli

    MODE, HOW = sys.argv[1], sys.argv[2]

    @click.command()
    def boom():
        try:
            if MODE == "interrupt":
                os.kill(os.getpid(), signal.SIGINT)
            raise KeyboardInterrupt if HOW == "plain" else RuntimeError("a failure of its own")
        except KeyboardInterrupt as exc:
            if HOW == "plain":
                raise
            raise RuntimeError("serializing failed: KeyboardInterrupt") from exc  # what pydantic does

    cli.COMMANDS["boom"] = "__main__:boom"
    sys.argv = ["pipeline", "boom"]
    cli.run()
    """
)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("how", ["plain", "wrapped"])
def test_a_sigint_ends_the_stage_with_130_whatever_error_it_became(how):
    done = _run("interrupt", how)
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "aborted" and "Traceback" not in done.stderr


def test_an_error_without_a_sigint_is_not_taken_for_one():
    done = _run("no-interrupt", "wrapped")
    assert done.returncode == 1 and "RuntimeError: a failure of its own" in done.stderr
