"""A warm `python -m pipeline` for tests that run many short commands (bad inputs, each refused in one line).

A cold `python -m pipeline CMD` spends ~4 s importing torch and the command's module before it reads its
first argument; a test of eleven refusals spends most of its minute there. Here one interpreter, started
from the repository root as `python -m pipeline` is, imports `pipeline.cli` and then, on a command's first
use, that command's module (what `LazyGroup.get_command` imports); then it forks one child per command. The
child is the real CLI (`python -m pipeline`'s own `__main__`, through runpy): its own cwd, environment,
argv, stdin from /dev/null, stdout and stderr to files, its exit code as the process's. What a command's
import writes (once, in the server) is prepended to every child's output, as a cold run would show it.

The server also imports what every working command imports (``PRELOAD``: torch, transformers' model base,
safetensors), so that a command that does real work (prepare, extract, verify, train) does not pay ~4 s of
imports either: `tests.conftest.run_pipeline` sends every command here, in .venv and .venv-vllm alike (the
server never imports vLLM).

Differences from a cold run, and why they do not touch what the tests assert: modules are imported before
the child's environment is set (a variable read at import time is read from the server's environment, the
test run's own; no test sets one that torch or transformers reads at import), and the server never runs a
command itself, so no thread pool (torch's OpenMP pool included) exists when it forks.

Run as `python -m tests.warm_cli` (one JSON request per stdin line, one JSON answer per stdout line);
`WarmPipeline` is the test side."""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from pipeline.runtime.process_exit import exit_status, finish

REPO = Path(__file__).resolve().parent.parent


def _capture_fds(work):
    """Run WORK() with fds 1 and 2 sent to temp files; (its result, stdout bytes, stderr bytes)."""
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        try:
            result = work()
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])
        out.seek(0), err.seek(0)
        return result, out.read(), err.read()


def _child(req: dict, preamble: tuple[bytes, bytes]) -> None:
    """The forked child: become `python -m pipeline ARGV` in REQ's cwd and environment; never returns."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path, head in ((1, req["stdout"], preamble[0]), (2, req["stderr"], preamble[1])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(f, head)
            os.dup2(f, fd)
            os.close(f)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = ["pipeline", *req["argv"]]
        try:
            # `python -m pipeline`'s own __main__ ends the process itself (pipeline/runtime/process_exit.py)
            runpy.run_module("pipeline", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exit_status(exc)
        except BaseException:  # noqa: BLE001 - as Python does: the traceback on stderr, exit 1
            traceback.print_exc()
            code = 1
    finally:
        finish(code)


# What every command's run imports sooner or later (the stages' modules import them lazily, so a cold run pays
# them once it starts working): imported once by the server, so that no child pays them again
PRELOAD = ("torch", "numpy", "safetensors.torch", "transformers", "transformers.modeling_utils")


def serve(preload: tuple[str, ...] = PRELOAD) -> None:
    """Answer requests on stdin until it closes: {argv, cwd, env, stdout, stderr} -> {pid}, then
    {returncode}."""
    from pipeline.cli import COMMANDS  # imported first, as in a real run: it sets its environment defaults

    # what the preloaded imports print, a cold run prints when a command first imports them
    _, *first = _capture_fds(lambda: [importlib.import_module(m) for m in preload])
    proto_in, proto_out = sys.stdin, sys.stdout
    preambles: dict[str, tuple[bytes, bytes]] = {}
    for line in proto_in:
        req = json.loads(line)
        command = req["argv"][0] if req["argv"] else ""
        if command in COMMANDS and command not in preambles:
            module = COMMANDS[command].split(":")[0]
            _, out, err = _capture_fds(lambda module=module: importlib.import_module(module))
            preambles[command] = (first[0] + out, first[1] + err)
        preamble = preambles.get(command, (b"", b""))
        proto_out.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req, preamble)
        proto_out.write(json.dumps({"pid": pid}) + "\n")
        proto_out.flush()
        _, status = os.waitpid(pid, 0)
        proto_out.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        proto_out.flush()


class WarmPipeline:
    """The test side: `run(*args)` is `tests.conftest.run_pipeline(*args)` answered by a warm server."""

    def __init__(self, python: str = sys.executable):
        self._tmp = tempfile.TemporaryDirectory(prefix="warm-cli-")
        self._proc = subprocess.Popen(
            [python, "-m", "tests.warm_cli"],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        self._n = 0
        self.lock = threading.Lock()  # held by run_pipeline while a command is in flight
        self._pending = b""  # read from the server, not answered yet

    def _answer(self, timeout: float | None) -> dict:
        """The server's next line. Read from the pipe's fd with our own buffer: select() on a file object
        misses a line that its buffer already holds (a fast command's two lines read at once), and would
        then wait out the whole timeout."""
        fd = self._proc.stdout.fileno()
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the warm pipeline server exited ({self._proc.wait()})")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return json.loads(line)

    def run(
        self, *args, check: bool = False, timeout: float = 600, env: dict | None = None
    ) -> subprocess.CompletedProcess:
        """ARGS as one `python -m pipeline` command from the repository root; ENV is added to its
        environment."""
        argv = [str(a) for a in args]
        self._n += 1
        out, err = (Path(self._tmp.name) / f"{self._n}.{s}" for s in ("out", "err"))
        env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **(env or {})}
        self._proc.stdin.write(
            json.dumps({"argv": argv, "cwd": str(REPO), "env": env, "stdout": str(out), "stderr": str(err)})
            + "\n"
        )
        self._proc.stdin.flush()
        pid = self._answer(120)["pid"]
        try:
            code = self._answer(timeout)["returncode"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._answer(60)
            raise subprocess.TimeoutExpired(["pipeline", *argv], timeout) from None
        proc = subprocess.CompletedProcess(["pipeline", *argv], code, out.read_text(), err.read_text())
        if check and code != 0:
            raise AssertionError(f"pipeline {argv[0]} failed ({code}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=60)
        self._tmp.cleanup()


if __name__ == "__main__":
    serve()
