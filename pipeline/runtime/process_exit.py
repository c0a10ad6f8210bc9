"""How a `python -m pipeline` process ends.

Python's own exit does two things after a command returns: what a program can observe (non-daemon threads
joined, atexit handlers run, stdout and stderr flushed, the status SystemExit asked for), and then the
teardown of every module and of the native libraries behind them (torch's allocators, the CUDA context),
which nothing observes. `run_then_exit` does the first part as Python does, then ends the process with
``os._exit``; the kernel frees its memory and the driver its GPU context either way.

Why: on the H200 that teardown took 1.6-1.8 s after `pipeline extract`'s last line, and ~1 s on a 2-core
CPU with a tiny model (docs/benchmarks-history.md, "The seconds after the closing line"). It is safe here
because nothing this project writes waits for teardown: every output is closed, and renamed into place, by the
code that wrote it before the command returns; logging's handlers and ``weakref.finalize`` callbacks
(vLLM's engine shutdown) run as atexit handlers.

An exception other than SystemExit is left to Python: its traceback and ordinary teardown.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def exit_status(exc: SystemExit) -> int:
    """The status Python's own exit gives for SystemExit(code) (a non-int code is printed, status 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def finish(code: int) -> NoReturn:
    """Join the non-daemon threads, run the atexit handlers, flush stdout and stderr, as Python's exit does,
    then end with ``code`` (130 if interrupted meanwhile) without the interpreter's teardown."""
    try:
        # Py_FinalizeEx's own first steps, in its order: threading's exit hooks (concurrent.futures wakes
        # the idle workers of executors never shut down, which are not daemons) and the join of every
        # non-daemon thread; then the atexit handlers (a failing one's traceback is printed, as Python does)
        threading._shutdown()
        atexit._run_exitfuncs()
    except KeyboardInterrupt:
        code = 130  # Ctrl-C while waiting for a thread or a handler: not a clean exit, whatever the command
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def run_then_exit(main: Callable[[], object]) -> NoReturn:
    """Run ``main`` (a CLI entry point that may raise SystemExit), then `finish` with its status."""
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exit_status(exc)
    finish(code)
