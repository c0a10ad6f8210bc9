"""Where a Python process's wall time goes, on every thread: a sampling profiler that needs nothing installed.

    python -m bench.stacks record --out FILE.json.gz [--interval 0.02] -- -m pipeline extract ...
    python -m bench.stacks summarize FILE.json.gz [--from S] [--to S] [--thread MainThread] [--top 25]

``record`` runs a module (``-m``) or a script in this interpreter with a daemon thread that, every
``--interval`` seconds, reads every other thread's Python stack (``sys._current_frames``) and counts it,
collapsed (``thread;file:function;...``, outermost first), per whole second since the start. The counts are
written when the program ends through its atexit handlers (Python's own exit, or
pipeline/runtime/process_exit.py's ``finish``, which runs them before ``os._exit``). Native work shows as the
Python frame that called it (a Triton compile as ``triton/compiler``, a CUDA wait as the frame that
synchronizes), which is what a start-up question needs: which step of the engine's start the seconds went to.

Why not cProfile: it sees one thread and charges its own overhead to every call; vLLM's engine at tensor
parallel 1 steps in the extract process beside our writer threads. Why not py-spy: nothing can be installed
on the lent GPU machine. The sampler costs the profiled program a little GIL time (one walk of every stack
per interval): figures of a sampled run are for where the time goes, not for the loop's speed.

``summarize`` prints, for a window of seconds and a thread, each function's inclusive seconds (its samples,
counted once per stack) and the leaf functions' own seconds.
"""

from __future__ import annotations

import atexit
import collections
import gzip
import json
import re
import runpy
import sys
import threading
import time
from pathlib import Path

import click

MAX_DEPTH = 60  # innermost frames kept per stack
LIBRARY = re.compile(r"^.*/(site-packages|dist-packages|lib/python3\.\d+)/")  # dropped from file names


def frame_name(frame) -> str:
    code = frame.f_code
    return f"{LIBRARY.sub('', code.co_filename)}:{code.co_name}"


def collapse(thread_name: str, frame) -> str:
    """One stack as ``thread;outer;...;inner`` (pure but for reading the frames)."""
    names = []
    while frame is not None and len(names) < MAX_DEPTH:
        names.append(frame_name(frame))
        frame = frame.f_back
    return ";".join([thread_name, *reversed(names)])


class Sampler:
    """Counts every other thread's collapsed stack, per second since ``start``."""

    def __init__(self, interval: float):
        self.interval = interval
        self.counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._t0 = time.monotonic()

    def start(self) -> Sampler:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            second = int(time.monotonic() - self._t0)
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    self.counts[second][collapse(names.get(ident, f"thread-{ident}"), frame)] += 1

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=5)
        return {
            "interval": self.interval,
            "argv": sys.argv,
            "seconds": {str(s): dict(c) for s, c in sorted(self.counts.items())},
        }


def write(path: Path, record: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt") as fh:
        json.dump(record, fh)
    tmp.replace(path)


def load(path: Path) -> dict:
    with gzip.open(path, "rt") as fh:
        return json.load(fh)


def seconds(
    record: dict, start: float, end: float, thread: str | None
) -> tuple[collections.Counter, collections.Counter, float]:
    """Over seconds [start, end) of ``thread`` (every thread when None): each function's inclusive seconds
    (counted once per stack), each leaf function's own seconds, and the seconds sampled (pure)."""
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    total = 0
    for second, stacks in record["seconds"].items():
        if not start <= int(second) < end:
            continue
        for stack, n in stacks.items():
            parts = stack.split(";")
            if thread is not None and parts[0] != thread:
                continue
            total += n
            for name in set(parts[1:]):
                inclusive[name] += n
            own[parts[-1]] += n
    dt = record["interval"]
    return (
        collections.Counter({k: n * dt for k, n in inclusive.items()}),
        collections.Counter({k: n * dt for k, n in own.items()}),
        total * dt,
    )


def table(record: dict, start: float, end: float, thread: str | None, top: int) -> list[str]:
    """`seconds` as markdown lines, the ``top`` functions of each list (pure)."""
    inclusive, own, total = seconds(record, start, end, thread)
    lines = [f"{total:.1f} thread-seconds sampled in [{start:g}, {end:g}) s, thread {thread or 'all'}"]
    lines += ["", "| inclusive s | function |", "|---:|---|"]
    lines += [f"| {s:.1f} | {name} |" for name, s in inclusive.most_common(top)]
    lines += ["", "| own s | function |", "|---:|---|"]
    lines += [f"| {s:.1f} | {name} |" for name, s in own.most_common(top)]
    return lines


@click.group()
def cli() -> None:
    """Sample a Python program's stacks on every thread; summarize them."""


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Where the counts go (.json.gz).")
@click.option("--interval", type=float, default=0.02, show_default=True, help="Seconds between samples.")
@click.argument("program", nargs=-1, type=click.UNPROCESSED, required=True)
def record(out: Path, interval: float, program: tuple[str, ...]) -> None:
    """Run PROGRAM (``-m module args...`` or ``script.py args...``) here, sampled."""
    args = program_args(program)
    sampler = Sampler(interval).start()
    atexit.register(lambda: write(out, sampler.stop()))
    run_program(args)


def program_args(program: tuple[str, ...]) -> list[str]:
    """``-m MODULE [ARGS]`` or ``SCRIPT [ARGS]`` from a command's trailing arguments (a leading ``--``
    dropped), or a usage error."""
    args = list(program)
    if args and args[0] == "--":
        args = args[1:]
    if not args or (args[0] == "-m" and len(args) < 2):
        raise click.UsageError("name the program: -m MODULE [ARGS] or SCRIPT [ARGS]")
    return args


def run_program(args: list[str]) -> None:
    """Run ``program_args``' program in this interpreter as its ``__main__``, with its own argv."""
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")


@cli.command()
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--from", "start", type=float, default=0.0, show_default=True)
@click.option("--to", "end", type=float, default=float("inf"))
@click.option("--thread", default=None, help="One thread's name (default: every thread).")
@click.option("--top", type=int, default=25, show_default=True)
def summarize(path: Path, start: float, end: float, thread: str | None, top: int) -> None:
    """Inclusive and own seconds per function in a window of a recorded run."""
    click.echo("\n".join(table(load(path), start, end, thread, top)))


if __name__ == "__main__":
    cli()
