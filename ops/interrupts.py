"""Ctrl-C (SIGINT) during a run: when it takes effect, and the test seam that pauses at a named point.

Owns the policy: a first Ctrl-C is deferred to the next step boundary (a step that stops the server,
frees GPUs, starts or collects a container runs to its end, so nothing is left half done), except
inside blocks marked interruptible (waiting for the host lock, following the logs), where it acts at
once; a second Ctrl-C always acts at once. A multi-host run's per-host threads cannot receive signals:
ops.fanout's main thread hands each its Ctrl-C (`interrupt_thread`), and the same policy applies there,
with the KeyboardInterrupt raised into the thread only where it may act at once. Also owns
`pause_point`: with $EAGLE_OPS_PAUSE_AT=NAME the command stops at that point until SIGINT or SIGUSR1 (go
on), so tests can interrupt every step deterministically. Does not decide what to clean up:
ops.remote_run does.
"""

from __future__ import annotations

import ctypes
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
    """Installs the SIGINT handler for its `with` block (main thread), or registers the block so that
    `interrupt_thread` finds it (any other thread)."""

    _active: dict[int, "Interrupts"] = {}  # thread ident -> the block running in that thread
    _registry = threading.Lock()

    def __init__(self, console: Console) -> None:
        self.console = console
        self.pending = False
        self._immediate = False
        self._old = None
        self._thread: int | None = None
        self._lock = threading.Lock()  # orders `request` against leaving an interruptible block

    def __enter__(self) -> "Interrupts":
        self._thread = threading.get_ident()
        with Interrupts._registry:
            Interrupts._active[self._thread] = self
        # only the main thread may install handlers; a multi-host run's per-host threads get their Ctrl-C
        # from ops.fanout instead (`interrupt_thread`)
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        with Interrupts._registry:
            Interrupts._active.pop(self._thread, None)
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None

    def _handler(self, signum, frame) -> None:
        if self._immediate or self.pending:
            self.pending = False
            raise KeyboardInterrupt
        self.pending = True
        self.console.print(
            "[yellow]Ctrl-C[/]: finishing the current step, then stopping (Ctrl-C again to abort now)"
        )

    def checkpoint(self) -> None:
        """A step boundary: act on a deferred Ctrl-C."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        self.checkpoint()
        with self._lock:
            self._immediate = True
        try:
            self.checkpoint()  # a request from another thread that came in between
            yield
        finally:
            with self._lock:  # a `request` now either raised already or will find the block left
                self._immediate = False

    def request(self, now: bool = False) -> None:
        """A Ctrl-C handed over by another thread: raised into this block's thread at once inside an
        interruptible block or when `now` (the operator pressed again), else deferred to the next step
        boundary, exactly as the SIGINT handler does for a one-host run."""
        with self._lock:
            if now or self._immediate:
                self.pending = False
                raise_in_thread(self._thread)
            elif not self.pending:
                self.pending = True
                self.console.print("[yellow]Ctrl-C[/]: finishing the current step, then stopping")


def raise_in_thread(ident: int | None) -> None:
    """KeyboardInterrupt in thread `ident`, at its next Python instruction (a blocking C call ends first)."""
    if ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(KeyboardInterrupt))


def interrupt_thread(thread: threading.Thread, now: bool = False) -> None:
    """Hand a Ctrl-C to `thread`: to its run's `Interrupts` block when it is inside one (the policy above),
    else straight into the thread (it is connecting or reporting: nothing there is left half done)."""
    with Interrupts._registry:
        block = Interrupts._active.get(thread.ident) if thread.ident is not None else None
    if block is not None:
        block.request(now)
    else:
        raise_in_thread(thread.ident)


def pause_point(name: str, interrupts: Interrupts | None = None) -> None:
    """Test seam: when $EAGLE_OPS_PAUSE_AT is `name`, say so on stderr and wait until SIGINT (acted on
    as any Ctrl-C at this point) or SIGUSR1 (go on), at most PAUSE_LIMIT seconds."""
    if os.environ.get(PAUSE_ENV) != name:
        return
    resumed: list[int] = []
    main = threading.current_thread() is threading.main_thread()  # a per-host thread has no SIGUSR1 to go on
    old = signal.signal(signal.SIGUSR1, lambda *_: resumed.append(1)) if main else None
    print(f"paused at {name} ({PAUSE_ENV})", file=sys.stderr, flush=True)
    deadline = time.monotonic() + PAUSE_LIMIT
    try:
        while not resumed and not (interrupts and interrupts.pending) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        if main:
            signal.signal(signal.SIGUSR1, old)
