"""Where a real extraction loop's device time and its gaps go: torch's profiler over a window of its batches.

    python -m bench.loop_trace record --out FILE.json [--skip 8] [--batches 6] [--chrome FILE.json.gz] \\
        -- -m pipeline extract ...
    python -m bench.loop_trace summarize FILE.json

``record`` runs the program in this interpreter (bench/stacks.py's ``run_program``) and counts the batches
the extraction loop has captured (pipeline/extract/loop.py's ``_checked_items``: once per batch, on the main
thread, right after the batch was queued). After ``--skip`` batches (past the first shapes' compiles) it
starts torch's profiler, and after ``--batches`` more it stops it and writes ``--out`` at once (the program
goes on; its rate is slowed by the window and by writing the summary, so a traced row's tok/s is not a
figure to compare). The summary (``summarize_trace``):

* the window's wall seconds, its batches and tokens;
* on a GPU: the share of the window in which some kernel ran (the union over every stream), each stream's
  busy seconds by kind (kernels, copies, memsets), and the gaps in which no kernel ran: their count and
  seconds by size, and the longest ones with the kernels on either side and what each traced thread was
  doing then (its innermost op or CUDA runtime call);
* the CUDA runtime and driver calls of every thread (CUPTI traces them all), by thread and call: count,
  seconds, the longest. A launch that waits for room in the launch queue, a host allocation that pins
  memory, a synchronize: each shows here with its thread;
* the main thread's ops (torch's profiler records the ops of the thread that started it), outermost ones
  by seconds.

With ``--sync-debug`` the window also runs under ``torch.cuda.set_sync_debug_mode("warn")``: every call
that synchronizes with the device (an ``.item()``, a ``nonzero``, a copy to unpinned memory) is counted by
thread and by where it came from.

The profiler's own cost (a few microseconds per op) lands in the gaps it measures: compare windows traced
the same way, not a traced window with an untraced run.
"""

from __future__ import annotations

import atexit
import collections
import json
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

import click

from bench import stacks
from pipeline.ondisk.atomic import write_json

GAP_BUCKETS_US = (10, 100, 1000, 10_000)  # the gaps' histogram edges
GPU_CATEGORIES = {"kernel": "kernels", "gpu_memcpy": "copies", "gpu_memset": "memsets"}
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")
TOP = 12


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping or touching [start, end) intervals joined, in order (pure)."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def innermost(events: list[dict], at: float) -> str | None:
    """The name of the shortest of ``events`` (one thread's) that spans the moment ``at``, if any (pure)."""
    spanning = [e for e in events if e["ts"] <= at < e["ts"] + e["dur"]]
    return min(spanning, key=lambda e: e["dur"])["name"] if spanning else None


def outermost(events: list[dict]) -> list[dict]:
    """The events of one thread that no other of them contains (pure)."""
    out, end = [], float("-inf")
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def totals(events: list[dict], key) -> list[dict]:
    """Events grouped by ``key(event)``: count, seconds, the longest (ms), most seconds first (pure)."""
    groups: dict = collections.defaultdict(list)
    for e in events:
        groups[key(e)].append(e["dur"])
    rows = [
        {"name": k, "count": len(d), "seconds": sum(d) / 1e6, "longest_ms": max(d) / 1e3}
        for k, d in groups.items()
    ]
    return sorted(rows, key=lambda r: -r["seconds"])


def summarize_trace(trace: dict, threads: dict[int, str], main_tid: int) -> dict:
    """The window's figures (module docstring) from a chrome trace of torch's profiler; ``threads``: native
    thread id to name, ``main_tid``: the thread that ran the loop (pure)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]

    def thread(e) -> str:
        return threads.get(e.get("tid"), f"thread {e.get('tid')}")

    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    runtime = [e for e in events if e.get("cat") in RUNTIME_CATEGORIES]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    timed = gpu + runtime + ops
    span = (min(e["ts"] for e in timed), max(e["ts"] + e["dur"] for e in timed)) if timed else (0.0, 0.0)
    window_us = span[1] - span[0]
    out: dict = {"window_seconds": window_us / 1e6}
    if gpu:
        kernels = sorted((e for e in gpu if e["cat"] == "kernel"), key=lambda e: e["ts"])
        busy = merged([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
        busy_us = sum(b - a for a, b in busy)
        gaps = [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)]
        per_thread = collections.defaultdict(list)
        for e in runtime + ops:
            per_thread[thread(e)].append(e)
        ends = [e["ts"] + e["dur"] for e in kernels]

        def around(gap):  # the kernels that ended right before the gap and started right after it
            before = max(
                (e for e, end in zip(kernels, ends, strict=True) if end <= gap[0] + 1e-3),
                key=lambda e: e["ts"] + e["dur"],
            )
            after = next(e for e in kernels if e["ts"] >= gap[1] - 1e-3)
            return before["name"][:90], after["name"][:90]

        longest = sorted(gaps, key=lambda g: g[0] - g[1])[:TOP]
        streams = collections.defaultdict(lambda: collections.defaultdict(list))
        for e in gpu:
            streams[str(e.get("args", {}).get("stream"))][GPU_CATEGORIES[e["cat"]]].append(
                (e["ts"], e["ts"] + e["dur"])
            )
        out.update(
            kernels=len(kernels),
            kernel_busy_seconds=busy_us / 1e6,
            kernel_busy_share=busy_us / window_us if window_us else 0.0,
            streams={
                s: {kind: sum(b - a for a, b in merged(iv)) / 1e6 for kind, iv in kinds.items()}
                for s, kinds in sorted(streams.items())
            },
            gaps=gap_histogram([b - a for a, b in gaps]),
            longest_gaps=[
                {
                    "at_ms": (a - span[0]) / 1e3,
                    "us": b - a,
                    "between": around((a, b)),
                    "threads": {
                        name: doing
                        for name, evs in per_thread.items()
                        if (doing := innermost(evs, (a + b) / 2))
                    },
                }
                for a, b in longest
            ],
        )
    out["runtime_calls"] = totals(runtime, lambda e: f"{thread(e)}: {e['name']}")[: 2 * TOP]
    main_ops = [e for e in ops if e.get("tid") == main_tid] or ops
    out["main_thread_ops"] = totals(outermost(main_ops), lambda e: e["name"])[:TOP]
    return out


def gap_histogram(gaps_us: list[float]) -> dict:
    """The gaps' count and seconds per size bucket (``GAP_BUCKETS_US``), and in all (pure)."""
    edges = (0, *GAP_BUCKETS_US, float("inf"))
    buckets = {}
    for lo, hi in zip(edges, edges[1:]):
        inside = [g for g in gaps_us if lo <= g < hi]
        label = f"{lo:g}-{hi:g} us" if hi != float("inf") else f">= {lo:g} us"
        buckets[label] = {"count": len(inside), "seconds": sum(inside) / 1e6}
    return {"count": len(gaps_us), "seconds": sum(gaps_us) / 1e6, "by_size": buckets}


class SyncCounter:
    """Counts the synchronizing CUDA calls that torch's sync debug mode warns of, by thread and by the
    innermost frame outside torch that made them."""

    def __init__(self):
        self.where: collections.Counter = collections.Counter()
        self._show, self._filters = None, []

    def start(self) -> None:
        import torch

        self._show, self._filters = warnings.showwarning, list(warnings.filters)
        warnings.simplefilter("always")
        warnings.showwarning = self._count
        torch.cuda.set_sync_debug_mode("warn")

    def _count(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return self._show(message, category, filename, lineno, file, line)
        frames = [
            f
            for f in traceback.extract_stack()[:-1]
            if "/torch/" not in f.filename and "warnings" not in f.filename
        ]
        where = f"{frames[-1].filename}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"
        self.where[f"{threading.current_thread().name}: {where}"] += 1

    def stop(self) -> dict:
        import torch

        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._show
        warnings.filters[:] = self._filters
        return dict(self.where.most_common(TOP))


class Window:
    """The profiler over the loop's batches ``skip`` .. ``skip + batches``; writes the summary as it
    ends."""

    def __init__(self, out: Path, skip: int, batches: int, chrome: Path | None, sync_debug: bool):
        self.out, self.skip, self.batches, self.chrome = out, skip, batches, chrome
        self.sync = SyncCounter() if sync_debug else None
        self.seen = self.tokens = 0
        self.prof = self.t0 = None

    def batch(self, seqs) -> None:
        """One more batch queued: start or stop the window around it."""
        if self.seen == self.skip:
            self.start()
        elif self.prof is not None:
            self.tokens += sum(len(s) for s in seqs)
            if self.seen == self.skip + self.batches:
                self.stop()
        self.seen += 1

    def close(self) -> None:
        """At the program's exit: a window still open ends with the loop; one never opened is said."""
        if self.prof is not None:
            self.batches = self.seen - self.skip - 1
            self.stop()
        elif self.seen <= self.skip:
            print(
                f"loop_trace: the loop ran {self.seen} batches, none after --skip {self.skip}: "
                "nothing traced (lower --skip)",
                file=sys.stderr,
                flush=True,
            )

    def start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        gpu = torch.cuda.is_available()
        self.prof = profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if gpu else [])])
        self.prof.start()
        if self.sync is not None and gpu:
            self.sync.start()
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        import torch

        gpu = torch.cuda.is_available()
        syncs = self.sync.stop() if self.sync is not None and gpu else None
        if gpu:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        self.prof.stop()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            self.prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
        threads = {t.native_id: t.name for t in threading.enumerate()}
        summary = {
            "argv": sys.argv,
            "skip": self.skip,
            "batches": self.batches,
            "tokens": self.tokens,
            "wall_seconds": wall,
            **summarize_trace(trace, threads, threading.main_thread().native_id),
        }
        if syncs is not None:
            summary["syncs_by_caller"] = syncs
        self.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.out, summary)
        if self.chrome is not None:
            stacks.write(self.chrome, trace)
        self.prof = None
        print(f"loop_trace: {self.batches} batches traced into {self.out}", flush=True)


def install(window: Window) -> None:
    """Count the extraction loop's batches into ``window`` (its ``_checked_items`` runs once per batch)."""
    from pipeline.extract import loop

    checked = loop._checked_items

    def counted(backend, prepared, batch, seqs, *args, **kwargs):
        window.batch(seqs)
        return checked(backend, prepared, batch, seqs, *args, **kwargs)

    loop._checked_items = counted


def lines(summary: dict) -> list[str]:
    """The summary as markdown (pure)."""
    out = [
        f"{summary['batches']} batches, {summary['tokens']:,} tokens in {summary['wall_seconds']:.2f} s "
        f"(window {summary['window_seconds']:.2f} s)"
    ]
    if "kernels" in summary:
        g = summary["gaps"]
        out += [
            f"kernels ran {summary['kernel_busy_share']:.1%} of the window ({summary['kernels']:,} kernels); "
            f"{g['count']:,} gaps without one, {g['seconds']:.3f} s",
            "",
            "| gap size | count | s |",
            "|---|---:|---:|",
            *(f"| {k} | {v['count']:,} | {v['seconds']:.3f} |" for k, v in g["by_size"].items()),
            "",
            "| stream | " + " | ".join(GPU_CATEGORIES.values()) + " |",
            "|---|" + "---:|" * len(GPU_CATEGORIES),
            *(
                f"| {s} | " + " | ".join(f"{kinds.get(k, 0.0):.3f}" for k in GPU_CATEGORIES.values()) + " |"
                for s, kinds in summary["streams"].items()
            ),
            "",
            "| longest gaps: at ms | us | after | before | threads |",
            "|---:|---:|---|---|---|",
            *(
                f"| {x['at_ms']:.1f} | {x['us']:.0f} | {x['between'][0][:40]} | {x['between'][1][:40]} | "
                + "; ".join(f"{t}: {d}" for t, d in x["threads"].items())
                + " |"
                for x in summary["longest_gaps"]
            ),
        ]
    out += ["", "| runtime call | count | s | longest ms |", "|---|---:|---:|---:|"]
    out += [
        f"| {r['name']} | {r['count']:,} | {r['seconds']:.3f} | {r['longest_ms']:.2f} |"
        for r in summary["runtime_calls"]
    ]
    out += ["", "| main thread op | count | s |", "|---|---:|---:|"]
    out += [f"| {r['name']} | {r['count']:,} | {r['seconds']:.3f} |" for r in summary["main_thread_ops"]]
    if summary.get("syncs_by_caller"):
        out += ["", "| synchronizing call from | count |", "|---|---:|"]
        out += [f"| {k} | {n} |" for k, n in summary["syncs_by_caller"].items()]
    return out


@click.group()
def cli() -> None:
    """Trace a window of an extraction loop's batches; summarize it."""


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Where the summary goes (.json).")
@click.option(
    "--skip", type=click.IntRange(min=0), default=8, show_default=True, help="Batches before the window."
)
@click.option("--batches", type=click.IntRange(min=1), default=6, show_default=True, help="Batches traced.")
@click.option(
    "--chrome", type=click.Path(path_type=Path), default=None, help="Also the whole trace (.json.gz)."
)
@click.option("--sync-debug", is_flag=True, help="Count the main thread's synchronizing calls in the window.")
@click.argument("program", nargs=-1, type=click.UNPROCESSED, required=True)
def record(
    out: Path, skip: int, batches: int, chrome: Path | None, sync_debug: bool, program: tuple[str, ...]
) -> None:
    """Run PROGRAM (``-m pipeline extract ...``) here, its loop's batches ``--skip`` to ``--skip + --batches``
    traced."""
    args = stacks.program_args(program)
    window = Window(out, skip, batches, chrome, sync_debug)
    install(window)
    atexit.register(window.close)
    stacks.run_program(args)


@cli.command()
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def summarize(path: Path) -> None:
    """A recorded window's summary as markdown."""
    click.echo("\n".join(lines(json.loads(path.read_text()))))


if __name__ == "__main__":
    cli()
