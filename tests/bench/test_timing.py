"""bench/timing.py, the one timer of the benchmarks' child processes, on a real process."""

from __future__ import annotations

import sys

from bench.timing import timed


def test_a_timed_process_gives_its_lines_in_order_its_exit_code_and_a_log(tmp_path):
    """stdout and stderr arrive as one stream with rising stamps within the wall time; the exit code is the
    child's; the log holds each line with its stamp."""
    code = (
        "import sys, time; print('a', flush=True); time.sleep(0.2); print('b', file=sys.stderr); sys.exit(3)"
    )
    run = timed([sys.executable, "-c", code], log=tmp_path / "log")
    assert [line for _, line in run.lines] == ["a", "b"] and run.returncode == 3
    assert 0 <= run.lines[0][0] < run.lines[1][0] <= run.wall and run.lines[1][0] - run.lines[0][0] >= 0.15
    assert [row.split()[1] for row in (tmp_path / "log").read_text().splitlines()] == ["a", "b"]
    assert run.tail(1) == "b"
