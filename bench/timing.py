"""A child process timed from the outside: its wall seconds, exit code and output lines, each stamped with
the seconds since it started. The one timer every benchmark that runs a command uses."""

from __future__ import annotations

import contextlib
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Timed:
    wall: float  # seconds, start to exit
    returncode: int
    lines: list[tuple[float, str]]  # (seconds since start, line) of stdout and stderr together

    def tail(self, n: int = 15) -> str:
        return "\n".join(line for _, line in self.lines[-n:])


def timed(
    argv: list[str], env: dict | None = None, cwd: Path | None = None, log: Path | None = None
) -> Timed:
    """Run ``argv`` to its end (stdout and stderr as one stream, also written to ``log`` with each line's
    time)."""
    t0 = time.perf_counter()
    lines: list[tuple[float, str]] = []
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd
    )
    with contextlib.ExitStack() as stack:
        fh = stack.enter_context(open(log, "w")) if log is not None else None
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip()))
            if fh is not None:
                fh.write(f"{lines[-1][0]:9.2f} {line}")
        proc.wait()
    return Timed(time.perf_counter() - t0, proc.returncode, lines)
