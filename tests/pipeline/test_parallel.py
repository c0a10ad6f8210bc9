"""Data-parallel extraction on one host and sharding across hosts end as one contiguous, verified set."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import torch

from pipeline.ondisk import formats
from pipeline.extract.config import ExtractConfig
from pipeline.extract.plan import deal, plan_batches, plan_shard, shard_indices
from pipeline.extract.workers import worker_config
from tests.conftest import run_pipeline, run_extract


def test_shards_and_deals_cover_every_sample_once():
    """Host shards partition the samples; dealing a host's plan partitions its batches; both deterministic."""
    lengths = [(i * 37) % 100 + 1 for i in range(101)]
    seen = []
    for rank in range(3):
        plan = plan_shard(lengths, 3, rank, 300, 4)
        assert {i for b in plan for i in b.indices} == set(shard_indices(101, 3, rank))
        for worker in range(2):
            seen += [i for b in deal(plan, 2, worker) for i in b.indices]
    assert sorted(seen) == list(range(101))
    assert plan_shard(lengths, 1, 0, 300, 4) == plan_batches(lengths, 300, 4)


def test_deal_balances_padded_tokens():
    """Every worker's padded-token total is within one batch of every other's (round-robin was not)."""
    lengths = [(i * 7919) % 2000 + 48 for i in range(500)]
    plan = plan_batches(lengths, 8192, 64)
    biggest = max(b.padded_tokens for b in plan)
    for workers in (2, 3, 8):
        loads = [sum(b.padded_tokens for b in deal(plan, workers, w)) for w in range(workers)]
        assert max(loads) - min(loads) <= biggest, loads
        dealt = [b for w in range(workers) for b in deal(plan, workers, w)]
        assert sorted(dealt, key=plan.index) == plan  # every batch to exactly one worker


def test_a_worker_gets_every_field_of_the_launchers_config():
    """A worker's config is the launcher's with only its slot, its tensor parallel size (vllm) and the closing
    check and bar (the launcher's) changed; it reaches the worker as fields, through JSON, unchanged."""
    from pipeline.options import from_json, to_json

    launcher = ExtractConfig(
        prepared=Path("p"),
        model=Path("m"),
        out=Path("o"),
        backend="vllm",
        layer_ids=(1, 3),
        dtype="float32",
        max_batch_tokens=999,
        compile="off",
        max_batch_size=3,
        limit=7,
        resume=True,
        enforce_eager=True,
        trust_remote_code=True,
        closing_check="full",
        writer_threads=2,
        data_parallel=2,
        world_size=3,
        rank=2,
    )
    worker = worker_config(launcher, 1, tensor_parallel_size=4)
    changed = {k: v for k, v in asdict(worker).items() if asdict(launcher)[k] != v}
    assert changed == {"local_rank": 1, "tensor_parallel_size": 4, "verify": False, "progress": False}
    assert worker_config(replace(launcher, backend="hf"), 0, 4).tensor_parallel_size is None  # hf: no TP
    assert from_json(ExtractConfig, to_json(worker)) == worker


def test_data_parallel_files_equal_single_process(tmp_path, tiny_llama, prepared_llama):
    """Two worker processes write the same bytes as one process, as one set with one data_config.json."""
    common = [
        "extract",
        "--prepared",
        prepared_llama,
        "--model",
        tiny_llama,
        "--limit",
        16,
        "--max-batch-size",
        2,
        "--no-progress",
    ]
    run_pipeline(*common, "--out", tmp_path / "one", "--no-verify", check=True)
    proc = run_pipeline(*common, "--out", tmp_path / "two", "--data-parallel", 2, check=True)
    assert "OK" in proc.stdout
    assert formats.existing_data_indices(tmp_path / "two") == list(range(16))
    for i in range(16):
        assert (tmp_path / "one" / f"data_{i}.pt").read_bytes() == (
            tmp_path / "two" / f"data_{i}.pt"
        ).read_bytes()
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert (
        summary["ok"] is True and summary["stats"]["closing_check"] == "record"
    )  # the workers' records, folded


def test_hosts_shards_merge_into_one_verified_set(tmp_path, tiny_llama, prepared_llama):
    """Hosts 0 and 1 of 2 each verify their own shard; the merged directory verifies as a whole."""
    common = [
        "extract",
        "--prepared",
        prepared_llama,
        "--model",
        tiny_llama,
        "--limit",
        12,
        "--world-size",
        2,
        "--no-progress",
    ]
    for rank in (0, 1):
        run_pipeline(*common, "--rank", rank, "--out", tmp_path / f"host{rank}", check=True)
        assert formats.existing_data_indices(tmp_path / f"host{rank}") == list(range(rank, 12, 2))
        summary = json.loads((tmp_path / f"host{rank}" / "summary.json").read_text())
        assert (
            summary["ok"] is True and summary["stats"]["closing_check"] == "record"
        )  # its own shard's record
    # one host's shard alone is incomplete as a whole set
    assert run_pipeline("verify", tmp_path / "host0").returncode == 3
    merged = tmp_path / "merged"
    shutil.copytree(tmp_path / "host0", merged)
    for p in [
        *(tmp_path / "host1").glob("data_*.pt"),
        *(tmp_path / "host1").glob(formats.CHECKSUM_INDEX_GLOB),
    ]:
        shutil.copy(p, merged / p.name)
    run_pipeline("verify", merged, check=True)
    run_pipeline(
        "extract",
        "--prepared",
        prepared_llama,
        "--model",
        tiny_llama,
        "--limit",
        12,
        "--no-progress",
        "--no-verify",
        "--out",
        tmp_path / "single",
        check=True,
    )
    for i in range(12):  # other batch compositions: equal within fp32 summation-order error
        a = formats.read_sample(merged / f"data_{i}.pt")["hidden_states"]
        b = formats.read_sample(tmp_path / "single" / f"data_{i}.pt")["hidden_states"]
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)
    (merged / "data_5.pt").unlink()
    proc = run_pipeline("verify", merged, "--world-size", 2, "--rank", 1)
    assert proc.returncode == 3 and "data_5" in proc.stderr


def test_bad_parallel_flags(tmp_path, tiny_llama, prepared_llama):
    """A rank outside the world size is refused with one line, before anything is written."""
    proc = run_extract(
        prepared_llama,
        tiny_llama,
        tmp_path / "x",
        "--world-size",
        2,
        "--rank",
        2,
    )
    assert proc.returncode == 2 and "--rank 2" in proc.stderr
    assert not (tmp_path / "x").exists()
