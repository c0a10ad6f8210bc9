"""What a states producer waiting for room costs the trainer's thread (issue #31 item 3), side by side.

An online or hybrid `pipeline train` runs its states producer as a thread of the training process. When it
is ahead of the trainer it waits for room under the budget: until the trainer has read and deleted enough
transient states. This bench runs the real ``Producer._wait_for_room`` (pipeline/train/states.py) over a
states dir holding ``--waiting`` transient files, while the main thread does pure-Python work standing in
for the trainer's step loop, and a reader thread deletes one file every ``--read-every`` seconds (through
``states.freed``, as the trainer's dataset does). Two ways of waiting, in turns, in one process:

- ``poll``: the disk re-read every 5 ms (``ROOM_RECHECK_S = WAIT_POLL_S``; the wait before 2026-12-04 16:00);
- ``woken``: the disk re-read when the reader freed a state (``ROOM_RECHECK_S`` = 0.5 s at the latest).

Reported per way: the main thread's work done per second (relative to a run with no producer waiting) and
the producer's disk re-reads. Loads no model, uses no GPU.

    python -m bench.room_wait_bench --waiting 400 --seconds 3 --json-out runs/bench-room-wait.json
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import click

from pipeline.ondisk import formats
from pipeline.train import states


class _Prepared:
    """What the Producer reads of a prepared set before it runs: the samples' lengths."""

    def __init__(self, n: int):
        self.n = n

    def lengths(self) -> list[int]:
        return [1] * self.n


def _work(stop: threading.Event) -> int:
    """Pure-Python work until ``stop``: the trainer's thread's share of the GIL, counted."""
    done = 0
    while not stop.is_set():
        sum(i * i for i in range(200))
        done += 1
    return done


def run_once(directory: Path, waiting: int, seconds: float, read_every: float, recheck: float | None) -> dict:
    """One timed run: ``recheck`` None runs the work alone (no producer waiting)."""
    for i in range(waiting):
        formats.data_file(directory, i).write_bytes(b"x")
    size = 1
    plan = states.StatesPlan("online", waiting * size, frozenset(), 0, waiting * size)
    producer = states.Producer(
        None,
        directory,
        _Prepared(waiting + 1),
        [waiting],
        plan,
        [size] * (waiting + 1),
        present=frozenset(),
        present_bytes=0,
        hidden_size=1,
        num_layers=1,
        max_batch_tokens=1,
        max_batch_size=1,
    )
    producer.waiting = {i: size for i in range(waiting)}  # the window is full: one more needs one freed
    rechecks = 0
    on_disk = producer._on_disk

    def counted() -> int:
        nonlocal rechecks
        rechecks += 1
        return on_disk()

    producer._on_disk = counted
    stop = threading.Event()
    waiter = None
    if recheck is not None:
        states.ROOM_RECHECK_S = recheck
        waiter = threading.Thread(target=lambda: producer._wait_for_room([waiting] * waiting), daemon=True)
        waiter.start()  # waits until every waiting file is gone (its chunk needs the whole window)

    def reader() -> None:
        for i in range(waiting):
            if stop.wait(read_every):
                return
            formats.data_file(directory, i).unlink()
            states.freed(directory)

    readers = threading.Thread(target=reader, daemon=True)
    readers.start()
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    t0, c0 = time.perf_counter(), time.process_time()
    done = _work(stop)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    readers.join()
    producer._stop.set()  # as Producer.stop() does, without its thread (never started here)
    with producer._freed:
        producer._freed.notify_all()
    producer.journal.close()
    if waiter is not None:
        waiter.join(timeout=5)
    for p in directory.glob("data_*.pt"):
        p.unlink()
    return {
        "work_per_s": done / elapsed,
        "rechecks": rechecks,
        "seconds": round(elapsed, 3),
        "cpu_per_s": round(cpu / elapsed, 3),  # the process's CPU seconds (all threads) per wall second
    }


@click.command()
@click.option("--waiting", default=400, show_default=True, help="Transient states waiting to be read.")
@click.option("--seconds", default=3.0, show_default=True, help="Length of each timed run.")
@click.option("--read-every", default=0.05, show_default=True, help="Seconds between the reader's deletes.")
@click.option("--turns", default=3, show_default=True, help="Runs per way, interleaved.")
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
def main(waiting: int, seconds: float, read_every: float, turns: int, json_out: Path | None) -> None:
    ways = {"alone": None, "poll": states.WAIT_POLL_S, "woken": states.ROOM_RECHECK_S}
    runs: dict[str, list[dict]] = {w: [] for w in ways}
    with tempfile.TemporaryDirectory(prefix="room-wait-") as tmp:
        for _ in range(turns):
            for way, recheck in ways.items():
                runs[way].append(run_once(Path(tmp), waiting, seconds, read_every, recheck))
    alone = statistics.median(r["work_per_s"] for r in runs["alone"])
    rows = {
        way: {
            "work_vs_alone": round(statistics.median(r["work_per_s"] for r in rs) / alone, 3),
            "rechecks_per_s": round(statistics.median(r["rechecks"] / r["seconds"] for r in rs), 1),
            "cpu_per_s": statistics.median(r["cpu_per_s"] for r in rs),
        }
        for way, rs in runs.items()
    }
    print(f"{waiting} states waiting, one read every {read_every} s, {turns} turns of {seconds} s, medians:")
    print("| producer | trainer thread's work vs. alone | disk re-reads per s | process CPU s per s |")
    print("|---|---:|---:|---:|")
    for way, row in rows.items():
        print(
            f"| {way} | {row['work_vs_alone']:.3f} | {row['rechecks_per_s']:.1f} | {row['cpu_per_s']:.2f} |"
        )
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({"rows": rows, "runs": runs, "waiting": waiting}, indent=2))


if __name__ == "__main__":
    main()
