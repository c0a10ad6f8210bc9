"""bench/capture_bench.py's tiny preset on the vLLM CPU build (issue #52): every kind of row runs as a fresh
process on one set and reports its figures; the extraction with the capture levers on writes the same bytes as
today's path (the CPU runs the same steps with the same kernels); the JSON holds each row as it finished.

Run with .venv-vllm's python (marked vllm: `make test-vllm` collects tests/bench; the light suite
deselects it).
No figure is asserted beyond its presence: speeds are the benchmark's, not a test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def test_capture_bench_tiny_runs_every_kind_of_row(tmp_path):
    out = tmp_path / "capture.json"
    argv = [sys.executable, "-m", "bench.capture_bench", "run", "--preset", "tiny"]
    argv += ["--workdir", str(tmp_path / "w"), "--json-out", str(out)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    tiny = json.loads(out.read_text())["shapes"]["tiny"]
    rows = tiny["rows"]
    assert list(rows) == [
        "cold",
        "plain",
        "capture",
        "thread",
        "hf",
    ]  # and hf-fused, skipped on a dense model
    assert "hf-fused-tiny: skipped (a dense model has no experts to fuse)" in proc.stdout
    assert all(r["loop_tokens_per_s"] > 0 and r["vs_plain"] > 0 for r in rows.values())
    assert rows["plain"]["vs_plain"] == 1.0 and rows["plain"]["stats"]["tokens"] == tiny["tokens"]
    assert rows["capture"]["stats"]["connector"]["save_steps"] == 0  # the null connector copies nothing
    for name in ("cold", "thread"):
        where = rows[name]["where"]
        assert where["gb_copied"] > 0 and where["engine_steps"] >= 1 and where["save_steps"] >= 1, where
        assert where["connector_engine_thread_seconds"] > 0 and where["writer_write_thread_seconds"] > 0
    assert rows["cold"]["where"]["levers"].startswith("none")
    assert rows["thread"]["where"]["levers"] == "bulk, pool 4, thread"
    assert rows["thread"]["where"]["connector_own_thread_seconds"] > 0
    assert rows["cold"]["where"]["gb_copied"] == rows["thread"]["where"]["gb_copied"]
    # the same steps on the CPU: the levers' files are today's byte for byte
    assert rows["thread"]["same_files"] == {"as": "cold", "same": 12, "files": 12}
    hf = rows["hf"]["where"]
    assert hf["writer_write_thread_seconds"] > 0 and "connector" not in rows["hf"]["stats"]["backend"]
    assert hf["hf_host"]["forward_queue_seconds"] > 0 and hf["hf_host"]["device_busy_seconds"] > 0
    assert "| tiny | thread |" in proc.stdout


def test_every_row_has_a_plan_and_the_compiled_hf_row_asks_for_the_compile():
    """Each row's kind and caches (pure): the vllm rows share cold's caches, each hf row has its own, and
    hf-compiled is hf with --compile on, hf-unfused and hf-fused hf with an MoE's experts off and
    through vLLM's kernel; an unknown row is refused naming the choices."""
    import click

    from bench.capture_bench import FUSED_ROWS, HF_ROWS, ROWS, row_plan

    kinds = {row: row_plan(row, 16384)[:2] for row in ROWS}
    assert kinds["hf"] == ("hf", "hf") and kinds["hf-compiled"] == ("hf", "hf-compiled")
    assert kinds["hf-compiled-warm"] == ("hf", "hf-compiled")  # the compiled row's caches
    assert {kinds[r] for r in ("cold", "warm", "bulk", "pool", "thread", "steps")} == {("extract", "cold")}
    assert {kinds[r] for r in ("plain", "capture")} == {("engine", "cold")}
    flags = {row: args for row, (_, args) in HF_ROWS.items()}
    assert flags == {
        "hf": [],
        "hf-compiled": ["--compile", "on"],
        "hf-compiled-warm": ["--compile", "on"],
        "hf-unfused": ["--fused-experts", "off"],
        "hf-fused": ["--fused-experts", "on"],
        "hf-fused-warm": ["--fused-experts", "on"],
        "hf-fused-w4": ["--fused-experts", "on", "--writer-threads", "4"],
        "hf-fused-w2": ["--fused-experts", "on", "--writer-threads", "2"],
    }
    assert kinds["hf-unfused"] == ("hf", "hf")
    assert FUSED_ROWS == (
        "hf-fused",
        "hf-fused-warm",
        "hf-fused-w4",
        "hf-fused-w2",
    )  # skipped on a dense model
    assert {kinds[r] for r in FUSED_ROWS} == {("hf", "hf-fused")}  # the fused row's caches
    with pytest.raises(click.BadParameter, match="hf-compiled"):
        row_plan("hf-eager", 16384)
