"""bench/loop_trace.py on a GPU: a real hf extraction's window has its kernels, their streams, the main
thread's launches and the synchronizing calls counted; the loop's stats carry the pinned pool and the threads'
CPU seconds. Run by `make test-vllm-gpu` before a traced bench spends a GPU call on it."""

from __future__ import annotations

import json

import pytest

from tests.bench.test_loop_trace import traced_extract

pytestmark = pytest.mark.gpu


def test_a_gpu_extraction_window_has_its_kernels_streams_launches_and_syncs(
    tmp_path, tiny_llama, prepared_llama
):
    summary, window = tmp_path / "w.json", ["--skip", "1", "--batches", "2", "--sync-debug"]
    more = ["--max-batch-tokens", "512", "--json-stats"]
    proc = traced_extract(summary, prepared_llama, tiny_llama, tmp_path / "s", window, "cuda", *more)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["batches"] == 2 and s["kernels"] > 0 and 0 < s["kernel_busy_share"] <= 1
    # the forward's stream and the copies' stream, each busy
    assert len(s["streams"]) >= 2 and any(kinds.get("copies", 0) > 0 for kinds in s["streams"].values())
    calls = {r["name"] for r in s["runtime_calls"]}
    assert "MainThread: cudaLaunchKernel" in calls or any(c.startswith("MainThread: cuLaunch") for c in calls)
    assert isinstance(s["syncs_by_caller"], dict)
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats["backend"]["pinned_pool"]["blocks_pinned"] > 0 and stats["main_thread_cpu_seconds"] > 0
