"""bench/stacks.py: the sampler sees every thread of a real process and its counts add up; the e2e bench's
sampled rows (``--stacks``) and its ``--no-naive`` mode run end to end on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import stacks

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import threading, time
def spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
def waiter():
    time.sleep(1.2)
t = threading.Thread(target=waiter, name="waiter")
t.start()
spin(0.8)
t.join()
"""


def test_record_samples_every_thread_of_a_real_program(tmp_path):
    script, out = tmp_path / "prog.py", tmp_path / "s.json.gz"
    script.write_text(PROGRAM)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.stacks",
            "record",
            "--out",
            str(out),
            "--interval",
            "0.01",
            "--",
            str(script),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    record = stacks.load(out)
    threads = {stack.split(";")[0] for second in record["seconds"].values() for stack in second}
    assert {"MainThread", "waiter"} <= threads
    _, own, total = stacks.seconds(record, 0, float("inf"), "waiter")
    assert 0.6 < own[f"{script}:waiter"] <= total < 1.6  # ~1.2 s asleep, sampled every 10 ms
    inclusive, _, _ = stacks.seconds(record, 0, float("inf"), "MainThread")
    assert 0.4 < inclusive[f"{script}:spin"] < 1.2  # ~0.8 s spinning


def test_table_counts_a_function_once_per_stack_and_keeps_to_its_window():
    record = {
        "interval": 0.5,
        "seconds": {
            "0": {"T;a;b;a": 2, "U;c": 4},
            "3": {"T;a;d": 1},
        },
    }
    inclusive, own, total = stacks.seconds(record, 0, 1, "T")
    assert total == 1.0 and inclusive == {"a": 1.0, "b": 1.0}  # a twice in one stack counts once
    assert own == {"a": 1.0}
    inclusive, own, total = stacks.seconds(record, 0, float("inf"), None)
    assert total == 3.5 and inclusive["a"] == 1.5 and inclusive["d"] == 0.5 and own["c"] == 2.0
    lines = stacks.table(record, 0, float("inf"), None, 1)
    assert lines[0].startswith("3.5 thread-seconds") and "| 2.0 | c |" in lines


@pytest.mark.slow
def test_e2e_bench_samples_its_rows_and_runs_without_the_naive_script(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.e2e_bench",
            "--shapes",
            "tiny",
            "--samples",
            "4",
            "--seq-length",
            "64",
            "--workdir",
            str(tmp_path / "w"),
            "--no-naive",
            "--stacks",
            str(tmp_path / "st"),
            "--also",
            "again@ours:",
            "--json-out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    tiny = json.loads(out.read_text())["shapes"]["tiny"]
    assert "naive" not in tiny and "whole_process_speedup" not in tiny
    assert set(tiny["rel_err_vs_fp32_per_layer"]) == {"ours", "again"}
    assert isinstance(tiny["ours"]["cache_mib"], dict)
    for row in ("ours", "again"):
        record = stacks.load(tmp_path / "st" / f"{row}-tiny.json.gz")
        names = {
            name for second in record["seconds"].values() for stack in second for name in stack.split(";")
        }
        assert any(name.startswith("pipeline/extract/") or "/pipeline/extract/" in name for name in names)
