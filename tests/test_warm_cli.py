"""tests/warm_cli.py answers as a cold `python -m pipeline` does: same exit code, stdout and stderr."""

from __future__ import annotations

import pytest

from tests.conftest import run_pipeline


@pytest.mark.parametrize("args", [("verify", "{tmp}/missing"), ("prepare", "--help"), ("no-such-stage",)])
def test_warm_run_equals_a_cold_run(warm_pipeline, tmp_path, args):
    args = [a.format(tmp=tmp_path) for a in args]
    warm, cold = warm_pipeline(*args), run_pipeline(*args, cold=True)
    assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr)
    assert cold.stdout or cold.stderr  # each case says something to compare
