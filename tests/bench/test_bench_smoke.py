"""The benchmark commands docs/benchmarks.md gives run end to end, at toy sizes on the CPU.

No figure is asserted (speed goals live in the benchmarks themselves, never in tests); what is asserted
is that each benchmark finishes, writes its JSON, and that the checks it carries hold: extract's agreement
with the naive reference, verify passing the set it built, scaling's shards adding up to every token.
An H200 run that dies on a broken benchmark costs device time that cannot be had back.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, *args, "--json-out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def _e2e(tmp_path: Path, shape: str, *extra: str) -> dict:
    """bench.e2e_bench on 6 samples of at most 128 tokens of ``shape``, working in ``tmp_path/w``."""
    argv = ["--shapes", shape, "--samples", "6", "--seq-length", "128", "--workdir", str(tmp_path / "w")]
    return _run(tmp_path, "-m", "bench.e2e_bench", *argv, *extra)


def test_extract_bench_agrees_with_the_naive_reference(tmp_path):
    r = _run(
        tmp_path,
        "-m",
        "bench.extract_bench",
        "--preset",
        "tiny",
        "--samples",
        "24",
        "--workdir",
        str(tmp_path / "w"),
    )
    assert r["samples"] == 24 and r["written_bytes"] > 0
    assert r["max_rel_err_vs_naive"] <= 2e-2  # the bench itself exits non-zero past this; checked here too
    assert r["ours_tokens_per_s"] > 0 and r["naive_tokens_per_s"] > 0


def test_hf_levers_runs_each_variant_and_holds_it_to_the_one_by_one_reference(tmp_path):
    """Every lever variant asked for reports a rate and its error against the plain path one sample at a
    time."""
    r = _run(
        tmp_path,
        "-m",
        "bench.hf_levers",
        "--shapes",
        "tiny",
        "--variants",
        "plain-16k,packed-32k,plain-32k-files",
        "--samples",
        "6",
        "--seq-length",
        "128",
        "--fp32-reference",
    )
    rows = r["shapes"]["tiny"]["variants"]
    assert set(rows) == {"plain-16k", "packed-32k", "plain-32k-files"}
    for row in rows.values():
        assert "error" not in row, row
        assert row["tokens_per_s"] > 0 and row["worst_rel_err_vs_one_by_one"] < 1e-4  # fp32 on the CPU
        assert len(row["rel_err_vs_fp32_per_layer"]) == 4
    # the variant with files runs plain-32k's backend with the extract loop's writer threads
    assert rows["plain-32k-files"]["writer_threads"] == 8 and rows["plain-16k"]["writer_threads"] == 0
    assert rows["plain-32k-files"]["files_written"] == 6 and rows["plain-16k"]["files_written"] == 0
    assert rows["plain-32k-files"]["max_batch_tokens"] == 32768


def test_hf_levers_runs_an_moe_once_per_experts_implementation_with_its_kernels(tmp_path):
    """On an MoE, each variant runs once per experts implementation asked for, the model's own restored
    after each, and --profile gives every row its kernel time by kind."""
    r = _run(
        tmp_path,
        "-m",
        "bench.hf_levers",
        "--shapes",
        "dsv3-tiny",
        "--variants",
        "packed-32k",
        "--experts",
        "eager,grouped_mm",
        "--samples",
        "4",
        "--seq-length",
        "64",
        "--profile",
    )
    rows = r["shapes"]["dsv3-tiny"]["variants"]
    assert set(rows) == {"packed-32k@eager", "packed-32k@grouped_mm"}
    for name, row in rows.items():
        assert "error" not in row, row
        assert row["experts_implementation"] == name.split("@")[1]
        assert row["worst_rel_err_vs_one_by_one"] < 1e-4
        assert sum(row["kernel_ms"].values()) > 0 and row["kernel_ms"].get("matmul", 0) > 0
        assert row["top_kernels"] and all(k["calls"] >= 1 for k in row["top_kernels"])


@pytest.mark.slow
def test_e2e_bench_runs_both_processes_and_checks_them_against_fp32(tmp_path):
    """The whole-process benchmark runs the real CLI, a baseline tree's CLI and the naive script on one set
    and reports all three; the writer's recorded facts are the file's own."""
    base = tmp_path / "base"
    for part in ("pipeline", "contract"):
        shutil.copytree(ROOT / part, base / part, ignore=shutil.ignore_patterns("__pycache__"))
    r = _e2e(tmp_path, "tiny", "--baseline", str(base))
    tiny = r["shapes"]["tiny"]
    assert (
        tiny["baseline"]["bytes"] == tiny["ours"]["bytes"] and tiny["baseline"]["closing_check"] == "record"
    )
    assert tiny["ours"]["facts_log_rms_drift"] == 0.0  # the CPU writer computes them from the very tensors
    assert tiny["ours"]["bytes"] > 0 and tiny["ours"]["bytes"] == pytest.approx(
        tiny["naive"]["bytes"], rel=0.01
    )
    assert tiny["ours"]["wall_seconds"] > tiny["ours"]["verify_seconds"] > 0
    assert tiny["ours"]["closing_check"] == "record"  # extract's default closing check
    assert set(tiny["ours"]["closing_check_seconds"]) == {"record", "full"}
    assert all(t > 0 for t in tiny["ours"]["closing_check_seconds"].values())
    assert "tok/s" in tiny["ours"]["closing_line"] and tiny["naive"]["loop_tokens_per_s"] > 0
    assert max(tiny["rel_err_vs_fp32_per_layer"]["ours"]) < 1e-4


@pytest.mark.slow
def test_e2e_bench_builds_an_moe_target_and_counts_the_experts_a_token_meets(tmp_path):
    """The DeepSeek-V3 layout's shape (MLA + MoE) runs through the product's CLI against fp32; its
    checkpoint spells out the routing vLLM would otherwise take as softmax; the FLOP count takes 2 of 8
    routed experts."""
    r = _e2e(tmp_path, "dsv3-tiny", "--no-naive")
    moe = r["shapes"]["dsv3-tiny"]
    assert moe["ours"]["bytes"] > 0 and max(moe["rel_err_vs_fp32_per_layer"]["ours"]) < 1e-4
    config = json.loads((tmp_path / "w" / "model-dsv3-tiny" / "config.json").read_text())
    assert (config["scoring_func"], config["topk_method"]) == ("sigmoid", "noaux_tc")
    routed = 7 * 8 * 3 * 256 * 128  # 7 MoE layers, 8 experts of gate, up and down 256 x 128
    assert moe["active_decoder_params"] == moe["decoder_params"] - routed + routed // 4


def test_e2e_bench_keeps_only_the_files_it_compares_before_the_naive_run(tmp_path):
    """After ours' figures, only the first COMPARED data files stay (the comparisons read no others); the rest
    of the directory is left alone, and the freed bytes are counted."""
    from bench import e2e_bench

    for i in range(20):
        (tmp_path / f"data_{i}.pt").write_bytes(b"x" * (i + 1))
    (tmp_path / "data_config.json").write_text("{}")
    freed = e2e_bench.keep_compared(tmp_path)
    left = sorted(int(p.stem.split("_")[1]) for p in tmp_path.glob("data_*.pt"))
    assert left == list(range(e2e_bench.COMPARED)) and (tmp_path / "data_config.json").is_file()
    assert freed == sum(i + 1 for i in range(e2e_bench.COMPARED, 20))
    assert e2e_bench.keep_compared(tmp_path) == 0


def test_verify_bench_compares_both_loaders_on_a_set_verify_passes(tmp_path):
    r = _run(
        tmp_path,
        "-m",
        "bench.verify_bench",
        "--dir",
        str(tmp_path / "v"),
        "--gb",
        "0.02",
        "--hidden",
        "64",
        "--seq-length",
        "256",
        "--workers",
        "0,2",
        "--repeat",
        "1",
    )
    assert set(r["gb_s"]) == {
        "naive",
        "verify_buffer_workers_0",
        "verify_weights_only_workers_0",
        "verify_buffer_workers_2",
        "verify_weights_only_workers_2",
    }
    assert r["files"] >= 8 and r["dd_read_gb_s"] > 0


@pytest.mark.slow
def test_scaling_bench_runs_both_sizes_and_verifies_the_last_set(tmp_path):
    r = _run(
        tmp_path,
        "-m",
        "bench.scaling_bench",
        "--preset",
        "tiny",
        "--samples",
        "24",
        "--sweep",
        "1,2",
        "--out-root",
        str(tmp_path / "s"),
    )
    assert [run["data_parallel"] for run in r["runs"]] == [1, 2]
    one, two = r["runs"]
    assert one["tokens"] == two["tokens"] == sum(w["tokens"] for w in two["workers"]) > 0
    assert r["verify_ok"] is True and r["verify_bytes"] == two["bytes"]
    # the warm-up wrote as much as one run's states (the files add ids, masks and their zip framing)
    assert 0.9 * one["bytes"] < r["warm_up"]["bytes"] <= one["bytes"]
    assert [dp for dp, _ in r["pair_scaling"]] == [2]


@pytest.mark.slow
def test_scaling_bench_without_verify_frees_the_last_set_before_dd(tmp_path):
    # a 103 GB set and a dd file of as much would hold 206 GB of RAM at once on a 256 GiB host (tmpfs)
    root = tmp_path / "s"
    r = _run(
        tmp_path,
        "-m",
        "bench.scaling_bench",
        "--preset",
        "tiny",
        "--samples",
        "16",
        "--sweep",
        "1",
        "--no-verify",
        "--out-root",
        str(root),
    )
    assert not (root / "run0-dp1").exists()
    assert "verify_ok" not in r and r["dd_read_gb_s"] > 0 and r["runs"][0]["bytes"] > 0


def test_loader_bench_times_both_dtypes_on_the_same_batches(tmp_path):
    r = _run(
        tmp_path,
        "-m",
        "bench.loader_bench",
        "--workdir",
        str(tmp_path / "w"),
        "--gb",
        "0.001",
        "--length",
        "128",
        "--hidden",
        "64",
        "--max-len",
        "256",
        "--rounds",
        "1",
    )
    assert set(r["tokens_per_s"]) == {"float32", "bfloat16"} and all(
        v > 0 for v in r["tokens_per_s"].values()
    )
    assert r["tokens_per_pass"] > 0 and not (tmp_path / "w").exists()


def test_e2e_bench_also_rows_take_environment_tokens_apart_from_flags():
    """--also 'NAME:VAR=VALUE --flag x': VAR=VALUE goes to the row's environment, the rest to extract; a
    lower-case or flag-like token stays a flag."""
    from bench import e2e_bench

    name, cache, flags, env = e2e_bench.parse_also(
        "files@vllm:VLLM_ENABLE_V1_MULTIPROCESSING=1 --backend vllm a=b"
    )
    assert (name, cache, env) == ("files", "vllm", {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert flags == ["--backend", "vllm", "a=b"]
    for line in (
        "INFO 12-03 21:00:01 [default_loader.py:291] Loading weights took 1.2 seconds",
        "(EngineCore pid=7) INFO 12-03 21:15:57 [core.py:281] init engine (profile, ...) took 9.81 seconds",
    ):
        assert e2e_bench.ENGINE_TIMING.search(line), line

    assert not e2e_bench.ENGINE_TIMING.search("extracted 4 samples into /x (1 batches run; 9 tok/s)")


def test_load_bench_reports_each_part_and_names_what_a_way_needs(tmp_path):
    """Each way runs in its own process; the product's reports its load part by part, and transformers'
    device_map, refused without accelerate (the image has none), is reported in one line, not a traceback."""
    accelerate = importlib.util.find_spec("accelerate") is not None
    r = _run(
        tmp_path, "-m", "bench.load_bench", "--shape", "tiny", "--repeat", "1", "--workdir", str(tmp_path)
    )
    host = r["runs"]["host"][0]
    parts = ("torch_import", "transformers_import", "model_read", "model_to_device")
    assert all(host[f"{p}_seconds"] >= 0 for p in parts) and "cuda_init_seconds" not in host
    assert sum(host[f"{p}_seconds"] for p in parts) <= host["load_seconds"] <= host["wall_seconds"]
    device_map = r["runs"]["device_map"][0]
    if accelerate:
        assert r["bit_identical"] is True
    else:
        assert "requires `accelerate`" in device_map["error"] and "\n" not in device_map["error"]
        assert r["bit_identical"] is None and r["host_over_device_map"] is None


def test_reader_start_bench_trains_the_same_draft_both_ways(tmp_path):
    """Both starts of the produced loaders' workers, one online row each: the bench's own check (the same
    draft both ways, or a non-zero exit) holds, and every figure is there."""
    r = _run(
        tmp_path,
        *("-m", "bench.reader_start_bench", "--workdir", str(tmp_path / "w"), "--conversations", "24"),
        *("--epochs", "1", "--workers", "1", "--modes", "online", "--repeat", "1"),
    )
    assert [(row["mode"], row["start"]) for row in r["rows"]] == [
        ("online", "spawn"),
        ("online", "forkserver"),
    ]
    assert len({row["acceptance"] for row in r["rows"]}) == 1
    assert all(row["validation_seconds"] > 0 and row["epoch0_seconds"] > 0 for row in r["rows"])
