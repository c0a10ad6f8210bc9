"""bench/loop_trace.py: the window's figures from a trace (kernel busy share, gaps and what ran around them,
runtime calls by thread), and a real ``pipeline extract`` traced over a window of its batches on the CPU."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import click
import pytest

from bench import capture_bench, e2e_bench, loop_trace, stacks
from pipeline.ondisk import formats

ROOT = Path(__file__).resolve().parents[2]


def kernel(name, ts, dur, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_a_trace_gives_busy_share_gaps_and_what_each_thread_did_in_them():
    trace = {
        "traceEvents": [
            kernel("gemm", 0, 100),
            kernel("norm", 50, 100),  # overlaps gemm: busy 0-150 once
            kernel("attn", 2150, 850),  # after a 2,000 us gap
            kernel("router", 3005, 5),  # after a 5 us gap
            {
                "ph": "X",
                "cat": "gpu_memcpy",
                "name": "Memcpy DtoH",
                "ts": 200,
                "dur": 400,
                "args": {"stream": 9},
            },
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaHostAlloc", "ts": 160, "dur": 1900, "tid": 2},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 2100, "dur": 10, "tid": 1},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 2120, "dur": 20, "tid": 1},
            {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 1000, "dur": 1200, "tid": 1},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1100, "dur": 900, "tid": 1},
            {"ph": "M", "name": "thread_name", "tid": 1},
        ]
    }
    s = loop_trace.summarize_trace(trace, {1: "MainThread", 2: "extract-writer-0"}, main_tid=1)
    assert s["window_seconds"] == 3010 / 1e6
    assert s["kernels"] == 4 and s["kernel_busy_seconds"] == (150 + 850 + 5) / 1e6
    assert s["streams"] == {"7": {"kernels": 1005 / 1e6}, "9": {"copies": 400 / 1e6}}
    assert s["gaps"]["count"] == 2 and s["gaps"]["seconds"] == 2005 / 1e6
    assert (
        s["gaps"]["by_size"]["0-10 us"]["count"] == 1 and s["gaps"]["by_size"]["1000-10000 us"]["count"] == 1
    )
    longest = s["longest_gaps"][0]
    assert longest["us"] == 2000 and longest["between"] == ("norm", "attn")
    # at the gap's middle (1,150 us) the main thread was in aten::mm (inside aten::linear), the writer pinning
    assert longest["threads"] == {"MainThread": "aten::mm", "extract-writer-0": "cudaHostAlloc"}
    calls = {r["name"]: r for r in s["runtime_calls"]}
    assert calls["MainThread: cudaLaunchKernel"]["count"] == 2
    assert calls["extract-writer-0: cudaHostAlloc"]["longest_ms"] == 1.9
    assert s["main_thread_ops"] == [
        {"name": "aten::linear", "count": 1, "seconds": 0.0012, "longest_ms": 1.2}
    ]
    text = "\n".join(loop_trace.lines({"batches": 2, "tokens": 10, "wall_seconds": 0.1, **s}))
    assert "| 1000-10000 us | 1 | 0.002 |" in text and "extract-writer-0: cudaHostAlloc" in text


def test_merged_joins_overlapping_and_touching_intervals():
    assert loop_trace.merged([(5, 6), (0, 2), (2, 3), (1, 1.5)]) == [(0, 3), (5, 6)]


def traced_extract(
    summary, prepared, model, out, window: list, device: str, *more
) -> subprocess.CompletedProcess:
    """``pipeline extract`` with the hf backend on ``device``, run through ``loop_trace record`` with the
    ``window`` options, its summary into ``summary``."""
    wrapper = ["-m", "bench.loop_trace", "record", "--out", str(summary), *window, "--"]
    extra = ["--backend", "hf", "--device", device, *more]
    argv = e2e_bench.extract_argv(prepared, model, out, extra, wrapper)
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_real_extraction_is_traced_over_its_window_and_still_completes(
    tmp_path, tiny_llama, prepared_llama
):
    out, summary = tmp_path / "states", tmp_path / "trace" / "w.json"
    window = ["--skip", "1", "--batches", "2", "--chrome", str(tmp_path / "trace.json.gz")]
    proc = traced_extract(
        summary, prepared_llama, tiny_llama, out, window, "cpu", "--max-batch-tokens", "512"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 batches traced" in proc.stdout
    s = json.loads(summary.read_text())
    assert s["batches"] == 2 and s["skip"] == 1 and 0 < s["tokens"] <= 2 * 512
    assert s["wall_seconds"] > 0 and "kernels" not in s  # the CPU: no device events
    ops = {r["name"] for r in s["main_thread_ops"]}
    assert any(name.startswith("aten::") for name in ops), ops
    chrome = stacks.load(tmp_path / "trace.json.gz")  # the whole trace, kept as asked
    assert any(e.get("cat") == "cpu_op" for e in chrome["traceEvents"])
    # the program went on past the window: every sample on disk, checked
    prepared = formats.read_prepared(prepared_llama)[0]
    assert len(list(out.glob("data_*.pt"))) == len(prepared.lengths())


def test_a_window_past_the_loop_says_nothing_was_traced(tmp_path, tiny_llama, prepared_llama):
    summary = tmp_path / "w.json"
    proc = traced_extract(summary, prepared_llama, tiny_llama, tmp_path / "s", ["--skip", "999"], "cpu")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "none after --skip 999: nothing traced (lower --skip)" in proc.stderr
    assert not summary.exists()


def test_capture_bench_traces_its_extraction_rows_through_the_window(tmp_path, capsys):
    """capture_bench's ``--trace``: each extraction row's argv runs through loop_trace with the window asked
    for, a malformed window is refused in one line, and a row's summary is read back and printed."""
    assert capture_bench.trace_window_of("3,4") == (3, 4)
    for bad in ("3", "a,b", "-1,2", "2,0"):
        with pytest.raises(click.BadParameter, match="give SKIP,BATCHES"):
            capture_bench.trace_window_of(bad)
    argv = capture_bench.trace_argv(tmp_path / "hf-tiny.json", 3, 4)
    assert argv[:3] == ["-m", "bench.loop_trace", "record"] and argv[-1] == "--"
    assert argv[argv.index("--skip") + 1] == "3" and argv[argv.index("--batches") + 1] == "4"
    assert capture_bench.traced_window(tmp_path / "hf-tiny.json") is None
    assert "hf-tiny: no traced window" in capsys.readouterr().out
    summary = {"batches": 4, "tokens": 9, "wall_seconds": 0.5, "window_seconds": 0.4, "runtime_calls": []}
    (tmp_path / "hf-tiny.json").write_text(json.dumps({**summary, "main_thread_ops": []}))
    assert capture_bench.traced_window(tmp_path / "hf-tiny.json")["tokens"] == 9
    assert "4 batches, 9 tokens in 0.50 s" in capsys.readouterr().out


def test_the_sync_counter_counts_each_synchronizing_call_by_thread_and_caller():
    """What torch's sync debug mode warns of is counted by thread and by the innermost frame outside torch;
    any other warning is shown as it would be."""
    counter, shown = loop_trace.SyncCounter(), []
    counter._show = lambda message, *args: shown.append(str(message))

    def launches_a_sync():
        counter._count("called a synchronizing CUDA operation", UserWarning, "x.py", 1)

    launches_a_sync()
    launches_a_sync()
    counter._count("something else", UserWarning, "x.py", 1)
    assert shown == ["something else"]
    [(where, n)] = counter.where.items()
    assert n == 2 and where.startswith("MainThread: ") and where.endswith(" launches_a_sync"), where
