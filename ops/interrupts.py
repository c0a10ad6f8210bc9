"""Ctrl-C (SIGINT) during a run: when it takes effect, and the test seam that pauses at a named point.

Owns the policy: a first Ctrl-C is deferred to the next step boundary (a step that stops the server,
frees GPUs, starts or collects a container runs to its end, so nothing is left half done), except
inside blocks marked interruptible (waiting for the host lock, following the logs), where it acts at
once; a second Ctrl-C always acts at once. Also owns `pause_point`: with $EAGLE_OPS_PAUSE_AT=NAME the
command stops at that point until SIGINT or SIGUSR1 (go on), so tests can interrupt every step
deterministically. Does not decide what to clean up: ops.remote_run does.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console

PAUSE_ENV = "EAGLE_OPS_PAUSE_AT"
PAUSE_LIMIT = 600.0


class Interrupts:
    """Installs the SIGINT handler for its `with` block."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.pending = False
        self._immediate = False
        self._old = None

    def __enter__(self) -> "Interrupts":
        # only the main thread may install handlers; a multi-host run's per-host threads get their Ctrl-C
        # from ops.fanout instead (raised into each thread), so for them this block installs nothing
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None

    def _handler(self, signum, frame) -> None:
        if self._immediate or self.pending:
            self.pending = False
            raise KeyboardInterrupt
        self.pending = True
        self.console.print("[yellow]Ctrl-C[/]: finishing the current step, then stopping (Ctrl-C again to abort now)")

    def checkpoint(self) -> None:
        """A step boundary: act on a deferred Ctrl-C."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        self.checkpoint()
        self._immediate = True
        try:
            yield
        finally:
            self._immediate = False


def pause_point(name: str, interrupts: Interrupts | None = None) -> None:
    """Test seam: when $EAGLE_OPS_PAUSE_AT is `name`, say so on stderr and wait until SIGINT (acted on
    as any Ctrl-C at this point) or SIGUSR1 (go on), at most PAUSE_LIMIT seconds."""
    if os.environ.get(PAUSE_ENV) != name:
        return
    resumed: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda *_: resumed.append(1))
    print(f"paused at {name} ({PAUSE_ENV})", file=sys.stderr, flush=True)
    deadline = time.monotonic() + PAUSE_LIMIT
    try:
        while not resumed and not (interrupts and interrupts.pending) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGUSR1, old)
